"""The step-time floor the search refuses plans by (`step_time_lower_bound`) is never above
what `predict` charges the plan, whatever plans were floored before it with the same
cache: a floor above its plan's price would drop a plan the search should weigh."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autopart.api import captured_for_planning
from autopart.cost_models import Choices, CostModels, predict, step_time_lower_bound
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
