"""Pipeline step time and bubble fractions (GPipe, 1F1B, interleaved 1F1B) and the
exposed part of gradient synchronization."""

from __future__ import annotations

import random

import pytest

from autopart.cost_models.choices import Choices, CostModels
from autopart.cost_models.comm import CommModel
from autopart.cost_models.pipeline import (
    bubble_fraction,
    bucket_sizes,
    exposed_sync,
    pipeline_step,
    schedule_span,
    span_floor,
)
from autopart.cost_models.predict import p2p_comm, pipeline_sends
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


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b"])
def test_no_split_of_the_work_among_ranks_steps_faster_than_the_span_floor(schedule):
    """The floor holds for uneven ranks too: a slow first rank of a 1F1B pipeline
    leaves the others less than a mean microbatch idle (4.43 and 4.15 s a microbatch
    over 2 microbatches span 12.73 s, where (m + p − 1) × the mean is 12.87)."""
    rng = random.Random(0)
    cases = [([4.43, 4.15], 2)] + [
        ([rng.uniform(0.01, 1.0) ** 3 for _ in range(rng.randint(2, 6))], rng.randint(1, 12))
        for _ in range(300)
    ]
    for times, m in cases:
        p, v = len(times), 2 if schedule == "interleaved-1f1b" else 1
        step = pipeline_step(times, [0.0] * p, m, schedule, v)
        assert span_floor(schedule, p, m, v) * sum(times) <= step.total * (1 + 1e-12), (times, m)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_balanced_step_is_m_plus_p_minus_one_stages(schedule):
    p, m = 4, 8
    step = pipeline_step([1.5] * p, [0.5] * p, m, schedule)
    assert step.total == pytest.approx((m + p - 1) * 2.0)
    assert step.compute == pytest.approx(m * 1.5)
    assert step.exposed_comm == pytest.approx(m * 0.5)
    assert step.bubble == pytest.approx((p - 1) * 2.0)


def test_1f1b_warm_up_forwards_fill_the_wait_of_a_slow_first_stage():
    # Stage 0 takes 1 + 2 a microbatch, stage 1 0.5 + 1. Stage 0 runs F0 F1 B0 F2 B1
    # F3 B2 B3, stage 1 F0 B0 F1 B1 ...: B0 comes back at 2.5 while stage 0's second
    # forward ends at 2, and later backwards come back before stage 0 is free, so the
    # step is 4 × 3 + 0.5, not (4 + 1) × 3.
    step = pipeline_step([3.0, 1.5], [0.0, 0.0], 4, "1f1b", forward_share=[1 / 3, 1 / 3])
    assert step.total == pytest.approx(12.5)
    assert step.bubble == pytest.approx(0.5)
    assert schedule_span([1.0, 0.5], [2.0, 1.0], 4, "1f1b") == pytest.approx(12.5)


def test_gpipe_runs_every_forward_then_every_backward_at_the_slowest_of_each():
    # Forwards pace at stage 0's 2, backwards at stage 1's 3: 1 + 4 × 2 ... a span of
    # (0.5 + 4 × 2) forwards through stage 1, then 4 × 3 backwards and stage 0's last.
    span = schedule_span([2.0, 0.5], [1.0, 3.0], 4, "gpipe")
    assert span == pytest.approx(2.0 * 4 + 0.5 + 3.0 * 4 + 1.0)
    step = pipeline_step([3.0, 3.5], [0.0, 0.0], 4, "gpipe", forward_share=[2 / 3, 0.5 / 3.5])
    assert step.total == pytest.approx(span)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_span_past_the_simulated_microbatches_grows_by_one_pace_each(schedule):
    forward, backward = [1.0, 0.4, 0.7], [2.1, 0.9, 1.6]
    spans = [schedule_span(forward, backward, m, schedule) for m in (8, 9, 64)]
    pace = spans[1] - spans[0]
    assert spans[2] == pytest.approx(spans[0] + 56 * pace)
    if schedule == "1f1b":
        assert pace == pytest.approx(3.1)  # the slowest rank's microbatch
    else:
        assert pace == pytest.approx(1.0 + 2.1)  # the slowest forward and backward


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
    return p2p_comm(64 * MB, choices, CostModels.of(mesh, "fp32"), rank)


def test_stage_transfers_cross_nodes_on_the_nic_and_stay_on_nvlink_inside_one():
    comm = CommModel(Mesh.cluster("a100-80g", nodes=2, per_node=8))
    nvlink, nic = comm.intra.time(1, 1, 64 * MB), comm.inter.time(1, 1, 64 * MB)
    assert nic > 5 * nvlink
    # Stage 0 sends activations to stage 1, in its node; stage 1 also gradients to
    # stage 0 and activations to stage 2, in the next; stage 3 only gradients.
    assert _transfers(0, "1f1b") == pytest.approx(nvlink)
    assert _transfers(1, "1f1b") == pytest.approx(nvlink + nic)
    assert _transfers(3, "1f1b") == pytest.approx(nvlink)
    # Each of the 4 ranks of a stage sends on its own NIC: the time of one send.
    assert comm.send_time(64 * MB, 4, 8, size=4) == pytest.approx(nic)


def test_interleaved_chunks_each_send_and_wrap_from_the_last_rank_to_the_first():
    comm = CommModel(Mesh.cluster("a100-80g", nodes=2, per_node=8))
    nvlink, nic = comm.intra.time(1, 1, 64 * MB), comm.inter.time(1, 1, 64 * MB)
    # Rank 0 holds chunks 0 and 4 of 8: chunk 0 sends its activation to rank 1, chunk 4
    # its activation to rank 1 and its gradient to rank 3, in the other node.
    assert _transfers(0, "interleaved-1f1b", 2) == pytest.approx(2 * nvlink + nic)
    # Rank 3 holds chunks 3, 7 and 11 of 12: all but the last send on to rank 0.
    assert _transfers(3, "interleaved-1f1b", 3) == pytest.approx(3 * nvlink + 2 * nic)


@pytest.mark.parametrize(
    ("pp", "dp", "tp", "v"), [(4, 2, 2, 1), (4, 2, 2, 3), (8, 1, 2, 2), (16, 1, 1, 1)]
)
def test_a_pipelines_sends_counted_by_link_are_every_ranks_sends(pp, dp, tp, v):
    # 2 nodes of 8: pipelines whose neighbours sit in one node, across the two, or both.
    mesh = Mesh.cluster("a100-80g", nodes=2, per_node=8)
    schedule = "interleaved-1f1b" if v > 1 else "1f1b"
    degrees = Degrees(pp=pp, dp=dp, tp=tp)
    choices = Choices(64, degrees, microbatches=pp, schedule=schedule, virtual_stages=v)
    models = CostModels.of(mesh, "fp32")
    every_rank = sum(p2p_comm(64 * MB, choices, models, r) for r in range(pp))
    assert pipeline_sends(64 * MB, choices, models) == pytest.approx(every_rank, rel=1e-12)


def test_end_ranks_of_a_1f1b_pipeline_send_once_a_microbatch():
    # Two CPU ranks: each sends one tensor a microbatch, its receive batched with it.
    mesh = Mesh.cluster("cpu", nodes=1, per_node=2)
    choices = Choices(global_batch=8, degrees=Degrees(pp=2), microbatches=4, schedule="1f1b")
    send = CommModel(mesh).send_time(MB, 0, 1)
    models = CostModels.of(mesh, "fp32")
    assert [p2p_comm(MB, choices, models, r) for r in (0, 1)] == [pytest.approx(send)] * 2


def test_interleaved_step_pays_more_transfers_for_a_v_times_smaller_bubble():
    p, m, v, t, send = 8, 16, 4, 1.0, 0.02
    plain = pipeline_step([t] * p, [2 * send] * p, m, "1f1b")
    interleaved = pipeline_step([t] * p, [2 * v * send] * p, m, "interleaved-1f1b", v)
    assert plain.bubble == pytest.approx((p - 1) * (t + 2 * send))
    assert interleaved.bubble == pytest.approx((p - 1) / v * (t + 2 * v * send))
    assert interleaved.exposed_comm == pytest.approx(v * plain.exposed_comm)
    assert interleaved.total < plain.total
