"""The step-time floor the search refuses plans by (`step_time_lower_bound`) is never above
what `predict` charges the plan, whatever plans were floored before it with the same
cache: a floor above its plan's price would drop a plan the search should weigh. Nor
are the gathers ZeRO-3 cannot hide (`unhidden_gathers`), which its floor of a fitted
plan adds, above what a rank is charged."""

from __future__ import annotations

import itertools
import sys
from dataclasses import replace

import pytest

from autopart.api import captured_for_planning
from autopart.cost_models import Choices, CostModels, predict, step_time_lower_bound
from autopart.cost_models.predict import (
    balanced_pipeline_floors,
    rank_segments,
    segment_times,
    unhidden_gathers,
)
from autopart.cost_models.stages import chunks_at_cuts
from autopart.cost_models.summary import GraphSummary
from autopart.degrees import Degrees
from autopart.mesh import Mesh
from tests.models import tiny_llama, token_batch

BATCH_SIZE, SEQ = 8, 16
PLANS = [
    Choices(BATCH_SIZE, Degrees(cp=2), zero=1, microbatches=8),
    Choices(BATCH_SIZE, Degrees(cp=2), zero=0, microbatches=8),
    Choices(BATCH_SIZE, Degrees(cp=2, dp=2), zero=2, microbatches=2),
    Choices(BATCH_SIZE, Degrees(pp=2, dp=2), microbatches=4, schedule="1f1b"),
    Choices(
        BATCH_SIZE,
        Degrees(pp=2, dp=2),
        microbatches=2,
        schedule="interleaved-1f1b",
        virtual_stages=2,
    ),
    Choices(BATCH_SIZE, Degrees(tp=2, dp=2), zero=3, microbatches=2),
    Choices(BATCH_SIZE, Degrees(cp=2, dp=2), zero=3, microbatches=2),
]


@pytest.fixture(scope="module")
def summary() -> GraphSummary:
    ids, _ = token_batch(BATCH_SIZE, SEQ)
    return GraphSummary(captured_for_planning(tiny_llama(), (ids,)).gm)


@pytest.mark.parametrize("order", [1, -1], ids=["zero-1-first", "zero-0-first"])
def test_every_floor_is_at_most_its_plans_price(summary, order):
    """One cache over plans in either order: the cp plan whose gradients are summed by
    the sync (ZeRO-0) and one that all-reduces them in backward at each of its
    microbatches (ZeRO-1) differ in their floors, and neither takes the other's. One
    device a node, on slow links: the all-reduces weigh."""
    cache: dict = {}
    for choices in PLANS[::order]:
        mesh = Mesh.cluster("a10-24g", nodes=choices.degrees.world_size, per_node=1)
        models = CostModels.of(mesh, "fp32")
        price = predict(summary, mesh, choices, {"seq": SEQ}, models).step_time_s
        exact = step_time_lower_bound(summary, choices, {"seq": SEQ}, models, cache)
        cheap = step_time_lower_bound(summary, choices, {"seq": SEQ}, models, cache, False)
        assert 0 < cheap <= exact <= price, choices


def test_the_floor_counts_the_least_bubble_any_split_of_the_work_leaves(summary):
    """A 1F1B pipeline of p ranks over m microbatches spans at least W / (1 − r^p),
    r = (m − 1)/m, W its ranks' summed work for one microbatch (`span_floor`): over 2
    ranks, 4/3 W for two microbatches of a size, 16/7 W for four of them."""
    mesh = Mesh.cluster("h100-80g", nodes=1, per_node=2)
    models = CostModels.of(mesh, "fp32")
    two = Choices(BATCH_SIZE, Degrees(pp=2), microbatches=2, schedule="1f1b")
    four = Choices(2 * BATCH_SIZE, Degrees(pp=2), microbatches=4, schedule="1f1b")
    floors = [step_time_lower_bound(summary, c, {"seq": SEQ}, models) for c in (two, four)]
    assert floors[0] / floors[1] == pytest.approx((4 / 3) / (16 / 7))


@pytest.mark.parametrize("device", ["a10-24g", "cpu"], ids=["overlapped", "on-cpu"])
def test_the_floor_counts_zero3s_gathers_where_they_outlast_the_compute(summary, device):
    """On slow links ZeRO-3's gathers and reduce-scatters outlast the compute they hide
    behind (on a CPU nothing hides): the floor grows by at least their bytes at the
    links' rate, and stays under the price."""
    slow = replace(Mesh.cluster(device, nodes=4, per_node=1).device, inter_node_bandwidth=1e6)
    mesh = Mesh.cluster(slow, nodes=4, per_node=1)
    models = CostModels.of(mesh, "fp32")
    plain, sharded = (Choices(BATCH_SIZE, Degrees(dp=4), zero=z) for z in (0, 3))
    floors = [step_time_lower_bound(summary, c, {"seq": SEQ}, models) for c in (plain, sharded)]
    price = predict(summary, mesh, sharded, {"seq": SEQ}, models).step_time_s
    assert floors[0] < floors[1] <= price


def _pipelines(batch: int, blocks: int):
    """GPipe and 1F1B plans of a model of `blocks` blocks, from 2 ranks to one a block,
    with and without ZeRO-3 and tensor parallelism."""
    for pp, tp, cp, zero, schedule in itertools.product(
        (2, 4, blocks), (1, 2), (1, 2), (0, 3), ("1f1b", "gpipe")
    ):
        for m in (pp, 4 * pp, 16 * pp):
            if batch % (2 * m) == 0:
                yield Choices(batch, Degrees(pp=pp, tp=tp, dp=2, cp=cp), zero, m, schedule)


@pytest.mark.parametrize("graph", ["gpt_graph", "llama3_8b_graph"])
def test_the_last_ranks_floor_is_at_most_the_price(graph, request):
    """A GPipe or 1F1B pipeline cut where blocks begin spans at least its ranks' summed
    work and m − 1 more microbatches of its last rank, which holds a block and the
    head, and the step's own work after them: never above the price (under context
    parallelism without its layout too), and above the geometric split's floor where
    the pipeline is as deep as the model (its last rank would hold less than a
    block). Cut where `predict` cuts it, its ranks' own work floors it closer, and
    its first rank's states and microbatches in flight its memory."""
    summary = GraphSummary(request.getfixturevalue(graph))
    blocks = sum(s.is_block for s in summary.evaluate({"batch": 1}))
    deeper = closer = 0
    for choices in _pipelines(256, blocks):
        world = choices.degrees.world_size
        mesh = Mesh.cluster("a100-80g", nodes=max(1, world // 8), per_node=min(8, world))
        models = CostModels.of(mesh, "bf16-mixed")
        c = replace(choices, precision="bf16-mixed")
        cache: dict = {}
        plain = step_time_lower_bound(summary, c, {}, models, cache)
        last = step_time_lower_bound(summary, c, {}, models, cache, last_rank=True)
        cheap = step_time_lower_bound(summary, c, {}, models, cache, False, last_rank=True)
        predicted = predict(summary, mesh, c, {}, models)
        price = predicted.step_time_s
        assert plain <= last <= price and cheap <= price, c
        deeper += c.pp == blocks and last > plain
        step, peak = balanced_pipeline_floors(summary, c, {}, models)
        assert 0 < step <= price and 0 < peak <= predicted.peak_memory_bytes, c
        closer += step > 0.9 * price
    assert deeper and closer


@pytest.mark.parametrize("graph", ["gpt_graph", "llama3_8b_graph"])
def test_an_interleaved_pipelines_balanced_floors_are_at_most_the_price(graph, request):
    """Interleaved 1F1B, cut where `predict` cuts it: m · t_s + Σ_{r≠s} t_r / v over
    its ranks' own work floors the step, and its first rank's states and microbatches
    in flight its memory; never above the price, and close to it."""
    summary = GraphSummary(request.getfixturevalue(graph))
    blocks = sum(s.is_block for s in summary.evaluate({"batch": 1}))
    closer = 0
    for pp, tp, cp, zero in itertools.product((2, 4), (1, 2), (1, 2), (0, 3)):
        for virtual, m in itertools.product((2, blocks // pp), (pp, 4 * pp, 16 * pp)):
            degrees = Degrees(pp=pp, tp=tp, dp=2, cp=cp)
            c = Choices(256, degrees, zero, m, "interleaved-1f1b", virtual, "bf16-mixed")
            world = degrees.world_size
            mesh = Mesh.cluster("a100-80g", nodes=max(1, world // 8), per_node=min(8, world))
            models = CostModels.of(mesh, "bf16-mixed")
            predicted = predict(summary, mesh, c, {}, models)
            step, peak = balanced_pipeline_floors(summary, c, {}, models)
            assert 0 < step <= predicted.step_time_s, c
            assert 0 < peak <= predicted.peak_memory_bytes, c
            closer += step > 0.9 * predicted.step_time_s
    assert closer


def _zero3_pipelines(batch: int, blocks: int, tp: int):
    """ZeRO-3 plans over 2 data-parallel ranks that recompute every block, without a
    pipeline and with 1F1B and interleaved 1F1B ones cut at evenly spaced blocks."""
    every = tuple(f"transformer.h.{k}" for k in range(blocks))
    for pp, schedule, virtual in ((1, None, 1), (2, "1f1b", 1), (2, "interleaved-1f1b", 2)):
        chunks = pp * virtual
        cuts = every[blocks // chunks :: blocks // chunks][: chunks - 1]
        for m in (pp, 4 * pp):
            degrees = Degrees(pp=pp, dp=2, tp=tp)
            yield Choices(batch, degrees, 3, m, schedule, virtual, recompute=every, stage_cuts=cuts)


@pytest.mark.parametrize("bandwidth", [1e8, 1.2e9])
def test_zero3s_least_gathers_are_at_most_what_each_rank_is_charged(
    gpt_graph, monkeypatch, bandwidth
):
    """Each rank's microbatch takes at least its segments' compute and the gathers
    ZeRO-3's forward cannot hide behind it (`unhidden_gathers`), whatever the stage
    cuts and recomputation. A block's buckets are priced one by one, as `predict`
    prices them: cut into buckets of a few MiB, every block is many gathers, each with
    its latency, and the bound grows by them. On links slow enough that the gathers
    outlast the forward: just so (recomputation hides them in backward), and far
    slower (backward shows them too)."""
    summary = GraphSummary(gpt_graph)
    blocks = sum(s.is_block for s in summary.evaluate({"batch": 1}))
    slow = replace(
        Mesh.cluster("a100-80g", nodes=2, per_node=1).device, inter_node_bandwidth=bandwidth
    )
    for tp in (1, 2):
        for c in _zero3_pipelines(16, blocks, tp):
            mesh = Mesh.cluster(slow, nodes=c.degrees.world_size // tp, per_node=tp)
            models = CostModels.of(mesh, "fp32")
            segments = rank_segments(summary, {"batch": c.microbatch_size}, c)
            again = [c.recomputes(s) for s in segments]
            times = segment_times(segments, models.compute, again)
            chunk_of = chunks_at_cuts(segments, c.stage_cuts)
            floors = []
            for bucket_mib in (128, 4):
                monkeypatch.setattr(
                    sys.modules["autopart.cost_models.predict"],
                    "ZERO3_BUCKET_BYTES",
                    bucket_mib * 2**20,
                )
                unhidden = unhidden_gathers(segments, c, models)
                assert unhidden is not None, c
                of_rank = [0.0] * c.pp
                for chunk, t, e in zip(chunk_of, times, unhidden):
                    of_rank[chunk % c.pp] += t.total + e
                charged = [s.microbatch_s for s in predict(summary, mesh, c, {}, models).stages]
                assert all(f <= s for f, s in zip(of_rank, charged)), (c, of_rank, charged)
                floors.append(of_rank)
            assert all(a < b for a, b in zip(*floors)), c
