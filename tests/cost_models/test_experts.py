"""What expert parallelism costs in memory, as the runtime holds it: each rank holds
1/ep of the experts, and ZeRO shards their optimizer state (at stage 3 the weights
too) over their dp replicas and the other weights' over dp × ep (`runtime/zero.py`,
`passes/zero.py`)."""

from __future__ import annotations

import pytest

from autopart.api import captured_for_planning
from autopart.mesh import Mesh
from autopart.solver import Pins, make_plan
from tests.models import tiny_mixtral, token_batch

FOUR_CPUS = Mesh.cluster("cpu", nodes=1, per_node=4)
ADAM_STATE = 8  # bytes a parameter: two fp32 moments


@pytest.fixture(scope="module")
def mixtral():
    """Tiny Mixtral and its capture, shared read-only by the plans below."""
    model = tiny_mixtral()
    return model, captured_for_planning(model, (token_batch(8)[0],), repeated_once=True)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_shards_the_experts_over_dp_and_the_rest_over_dp_and_ep(mixtral, zero):
    model, captured = mixtral
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    others = sum(p.numel() for p in model.parameters()) - experts
    assert experts and others
    pins = Pins.of(ep=2, dp=2, tp=1, pp=1, cp=1, zero=zero)
    plan = make_plan(captured, FOUR_CPUS, pins)
    held = experts / 2 + others  # this rank's: 1/ep of the experts
    shard = experts / 2 / 2 + others / 4 if zero else held
    memory = plan.predicted.memory
    assert memory["parameters"] == pytest.approx(4 * (shard if zero == 3 else held), abs=1)
    assert memory["optimizer"] == pytest.approx(ADAM_STATE * shard, abs=1)
    assert memory["gradients"] == pytest.approx(4 * (shard if zero >= 2 else held), abs=1)


def test_under_ep_and_tp_a_rank_holds_its_slice_of_its_experts(mixtral):
    """ep=2 × tp=2: the layout splits every expert column then row parallel, so a rank
    holds 1/(ep·tp) of the experts; the other weights as tp alone holds them."""
    model, captured = mixtral
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    plan = make_plan(captured, FOUR_CPUS, Pins.of(ep=2, tp=2, dp=1, pp=1, cp=1, zero=0))
    tp_alone = make_plan(captured, FOUR_CPUS, Pins.of(ep=1, tp=2, dp=2, pp=1, cp=1, zero=0))
    assert "row-parallel: " in plan.explain() and "experts.down_proj" in plan.explain()
    held = plan.predicted.memory["parameters"] / 4
    held_by_tp = tp_alone.predicted.memory["parameters"] / 4
    assert held == pytest.approx(held_by_tp - experts / 2 * (1 - 1 / 2), abs=1)
