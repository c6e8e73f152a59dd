"""`autopart.verify`: a plan's losses, outputs and gradients beside one device's, and the
first operator that diverges when a plan is broken."""

from __future__ import annotations

import functools

import pytest
import torch

import autopart
from autopart.testing import run_world
from autopart.verify import LOSS_RTOL, TENSOR_RTOL, on_rank
from tests.models import lm_loss, tiny_llama, tiny_mixtral, token_batch

STEPS = 2


def _verify(pins: dict, batch, broken: bool = False):
    """Plan `pins` for the running world and verify it; with `broken`, the all-reduce of
    the first row-parallel linear layer does nothing (a collective removed)."""
    if broken:
        _remove_the_first_linear_all_reduce()
    model = tiny_llama()
    ids, target = batch
    plan = autopart.plan(model, autopart.Mesh.local(), (ids,), **pins)
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-3)
    return on_rank(model, plan, (ids,), target, lm_loss, optimizer, STEPS)


def _remove_the_first_linear_all_reduce() -> None:
    import autopart.ops.collectives as collectives
    from autopart.ops.aten import op_name
    from autopart.passes.placement_rewrite import PlacementRewriter as _Rewriter

    reduce_after, all_reduce = _Rewriter.reduce_after, collectives.all_reduce
    broken = []

    def reduce_after_broken(self, node, target, has_bias):
        if not broken and op_name(node, self.gm) == "linear":
            broken.append(node.name)
            collectives.all_reduce = lambda x, group: x
        try:
            reduce_after(self, node, target, has_bias)
        finally:
            collectives.all_reduce = all_reduce

    _Rewriter.reduce_after = reduce_after_broken


@pytest.mark.slow  # the quick suite verifies tp=2 with a collective removed
@pytest.mark.parametrize("pins", [{"tp": 2}, {"dp": 2, "zero": 2}], ids=str)
def test_plans_that_keep_the_math_are_reported_as_matching(pins):
    report = run_world(_verify, 2, pins, token_batch(8))[0]
    assert report.ok, report
    assert report.loss <= LOSS_RTOL and report.first_divergence is None
    assert report.compared > 100 and report.not_compared == 0, report
    # every parameter's gradient, rebuilt from the ranks' pieces (ZeRO shards, tp slices)
    assert len(report.gradients) == len(dict(tiny_llama().named_parameters()))
    assert max(report.gradients.values()) <= TENSOR_RTOL


@pytest.mark.slow  # a world of 2 per plan verified
def test_a_plan_with_a_collective_removed_is_caught_at_the_first_operator_it_breaks():
    report = run_world(_verify, 2, {"tp": 2}, token_batch(8), True)[0]
    assert not report.ok
    divergence = report.first_divergence
    assert divergence is not None, report
    # Layer 0's attention output projection is row-parallel: its partial sums are no
    # longer added up, so the residual add right after it is the first wrong value.
    assert divergence.module_path.startswith("model.layers.0"), divergence
    assert divergence.op == "add" and divergence.difference > 0.1, divergence
    assert report.loss > 1e-3 and report.outputs > 0.1
    assert "first divergence: model.layers.0" in str(report)


@pytest.mark.slow  # a world of 4 processes: kept out of the quick suite
def test_a_pipeline_with_microbatches_and_tensor_parallelism_is_verified():
    report = run_world(_verify, 4, {"tp": 2, "pp": 2, "microbatches": 2}, token_batch(8))[0]
    assert report.ok, report
    assert report.compared > 100, report


def test_plans_whose_axes_it_cannot_set_side_by_side_are_refused_before_any_world():
    """An ep rank holds other tokens' rows than its (dp, tp) coordinates say: verify
    refuses rather than report false divergences."""
    ids, target = token_batch(8)
    mesh = autopart.Mesh.cluster("cpu", nodes=1, per_node=2)
    plan = autopart.plan(tiny_mixtral(), mesh, (ids,), ep=2)
    optimizer = functools.partial(torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="does not yet reassemble what ep=2 splits"):
        autopart.verify(tiny_mixtral(), plan, (ids,), target, lm_loss, optimizer)
