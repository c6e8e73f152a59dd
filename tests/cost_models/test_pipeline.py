"""Pipeline step time and bubble fractions (GPipe, 1F1B, interleaved 1F1B) and the
exposed part of gradient synchronization."""

from __future__ import annotations

import pytest

from autopart.cost_models.choices import Choices
from autopart.cost_models.comm import CommModel
from autopart.cost_models.pipeline import (
    bubble_fraction,
    bucket_sizes,
    exposed_sync,
    pipeline_step,
)
from autopart.cost_models.predict import p2p_comm
from autopart.degrees import Degrees
from autopart.mesh import Mesh

MB = 1e6


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_is_p_minus_one_over_m(schedule):
    # Narayanan et al. 2021, section 2.2.1: (p − 1)/m.
    assert bubble_fraction(schedule, stages=4, microbatches=8) == pytest.approx(3 / 8)
    assert bubble_fraction(schedule, stages=8, microbatches=64) == pytest.approx(7 / 64)


def test_interleaved_bubble_is_divided_by_the_virtual_stages():
    # Narayanan et al. 2021, section 2.2.2: (p − 1)/(v·m).
    assert bubble_fraction("interleaved-1f1b", 4, 8, virtual_stages=2) == pytest.approx(3 / 16)
    assert bubble_fraction("interleaved-1f1b", 8, 32, virtual_stages=4) == pytest.approx(7 / 128)


def test_no_pipeline_has_no_bubble():
    assert bubble_fraction(None, 1, 8) == 0.0
    assert bubble_fraction("1f1b", 1, 8) == 0.0


def test_step_is_m_plus_p_minus_one_slowest_stages():
    p, m = 4, 8
    step = pipeline_step([1.0, 1.5, 1.0, 1.2], [0.0, 0.5, 0.0, 0.1], m, "1f1b")
    slowest = 1.5 + 0.5
    assert step.total == pytest.approx((m + p - 1) * slowest)
    assert step.compute == pytest.approx(m * 1.5)
    assert step.exposed_comm == pytest.approx(m * 0.5)
    assert step.bubble == pytest.approx((p - 1) * slowest)


def test_interleaved_step_shrinks_the_bubble():
    p, m, v = 4, 8, 2
    step = pipeline_step([1.0] * p, [0.0] * p, m, "interleaved-1f1b", v)
    assert step.total == pytest.approx(m + (p - 1) / v)


def test_sync_hidden_behind_backward_but_the_last_bucket():
    assert exposed_sync(sync=3.0, overlappable=5.0, last_bucket=0.5) == 0.5
    assert exposed_sync(sync=8.0, overlappable=5.0, last_bucket=0.5) == pytest.approx(3.0)


def test_buckets():
    assert bucket_sizes(60, 25) == [25, 25, 10]
    assert bucket_sizes(50, 25) == [25, 25]
    assert bucket_sizes(0, 25) == []


def _transfers(rank: int, schedule: str, virtual_stages: int = 1) -> float:
    # 2 nodes of 8: pp=4 stages of tp=2 × dp=2 (4 ranks each), two stages per node.
    mesh = Mesh.cluster("a100-80g", nodes=2, per_node=8)
    choices = Choices(
        global_batch=16,
        degrees=Degrees(pp=4, dp=2, tp=2),
        microbatches=8,
        schedule=schedule,
        virtual_stages=virtual_stages,
    )
    return p2p_comm(64 * MB, choices, CommModel(mesh), rank)


def test_stage_transfers_cross_nodes_on_the_nic_and_stay_on_nvlink_inside_one():
    comm = CommModel(Mesh.cluster("a100-80g", nodes=2, per_node=8))
    nvlink, nic = comm.intra.time(1, 1, 64 * MB), comm.inter.time(1, 1, 64 * MB)
    assert nic > 5 * nvlink
    # Stage 0 talks only to stage 1, in its node; stage 1 also to stage 2, in the next.
    assert _transfers(0, "1f1b") == pytest.approx(2 * nvlink)
    assert _transfers(1, "1f1b") == pytest.approx(nvlink + nic)
    assert _transfers(3, "1f1b") == pytest.approx(2 * nvlink)
    # Each of the 4 ranks of a stage sends on its own NIC: the time of one send.
    assert comm.send_time(64 * MB, 4, 8, size=4) == pytest.approx(nic)


def test_interleaved_chunks_each_send_and_wrap_from_the_last_rank_to_the_first():
    comm = CommModel(Mesh.cluster("a100-80g", nodes=2, per_node=8))
    nvlink, nic = comm.intra.time(1, 1, 64 * MB), comm.inter.time(1, 1, 64 * MB)
    # Rank 0 receives chunk 2's input from rank 3, in the other node.
    assert _transfers(0, "interleaved-1f1b", 2) == pytest.approx(2 * (nvlink + nic))
    assert _transfers(3, "interleaved-1f1b", 3) == pytest.approx(3 * (nvlink + nic))


def test_interleaved_step_pays_v_times_the_transfers_for_a_v_times_smaller_bubble():
    p, m, v, t, send = 8, 16, 4, 1.0, 0.02
    plain = pipeline_step([t] * p, [2 * send] * p, m, "1f1b")
    interleaved = pipeline_step([t] * p, [2 * v * send] * p, m, "interleaved-1f1b", v)
    assert plain.bubble == pytest.approx((p - 1) * (t + 2 * send))
    assert interleaved.bubble == pytest.approx((p - 1) / v * (t + 2 * v * send))
    assert interleaved.exposed_comm == pytest.approx(v * plain.exposed_comm)
    assert interleaved.total < plain.total
