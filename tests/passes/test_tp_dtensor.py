"""DTensor's registered strategies as the strategy generator for operators without an
autopart rule: what it answers, and the answers it refuses after checking them on
shards."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from autopart.capture import capture
from autopart.ops.aten import op_name
from autopart.passes import analyze
from autopart.passes.tp_decision import NO_RULE, P
from autopart.passes.tp_dtensor import dtensor_decision
from autopart.passes.tp_propagate import gradient_flow, operands_of
from autopart.passes.tp_rules import decide

R = Replicate()


class OneOp(nn.Module):
    """One operator on the output of a linear layer (and a parameter, if it wants)."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn, self.up = fn, nn.Linear(8, 16)
        self.w = nn.Parameter(torch.randn(4, 16))

    def forward(self, x):
        return self.fn(self.up(x), self.w)


def _operands(fn, name: str, place, tp: int = 2):
    """The operands of the first `name` node, its input placed as `place`."""
    captured = capture(OneOp(fn), (torch.randn(4, 8),))
    analyze(captured.gm, captured.context())
    gm = captured.gm
    node = next(n for n in gm.graph.nodes if op_name(n, gm) == name)
    grads = gradient_flow(gm, captured.parameter_names)
    source = node.all_input_nodes[0]
    return operands_of(node, {source: place}, grads, tp), gm


def test_a_scan_along_an_unsharded_dim_keeps_the_shards():
    ops, _ = _operands(lambda h, w: torch.cumsum(h, dim=0), "cumsum", Shard(1))
    decision = dtensor_decision(ops)
    assert decision is not None
    assert decision.output == Shard(1) and decision.inputs == {}


def test_a_wrong_answer_is_refused_after_checking_it_on_shards():
    """DTensor's cumsum strategy keeps the shard of the dim it scans when the dim is
    given as -1: the shards' results differ from the whole's, so autopart falls back."""
    ops, gm = _operands(lambda h, w: torch.cumsum(h, dim=-1), "cumsum", Shard(1))
    assert dtensor_decision(ops) is None
    decision = decide(ops, gm)
    assert decision.fallback.startswith(NO_RULE) and decision.inputs == {0: R}


def test_a_multi_output_operator_places_each_output():
    ops, _ = _operands(lambda h, w: torch.sort(h, dim=0).values, "sort", Shard(1))
    decision = dtensor_decision(ops)
    assert decision is not None and decision.output == (Shard(1), Shard(1))


def test_a_sum_over_the_shards_is_partial():
    ops, _ = _operands(lambda h, w: torch.nansum(h, dim=1), "nansum", Shard(1))
    decision = dtensor_decision(ops)
    assert decision is not None and decision.output == P


def test_a_replicated_operand_is_converted_as_dtensor_asks():
    """stack wants its operands alike: the replicated parameter is sliced to the
    activation's shards (its gradient gathered back), and the output keeps them."""
    ops, _ = _operands(lambda h, w: torch.stack([h, w]), "stack", Shard(1))
    decision = dtensor_decision(ops)
    assert decision is not None and decision.output == Shard(2)
    assert decision.inputs == {1: Shard(1)} and decision.copy_to_group == set()


def test_nothing_sharded_is_left_to_the_rules():
    ops, _ = _operands(lambda h, w: torch.flip(h, dims=[0]), "flip", R)
    assert dtensor_decision(ops) is None


def test_random_operators_are_not_asked():
    ops, _ = _operands(lambda h, w: torch.rand_like(h), "rand_like", Shard(1))
    assert dtensor_decision(ops) is None
