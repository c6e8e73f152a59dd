"""Stage cuts and the pipeline pins of a plan."""

from __future__ import annotations

import functools
import itertools

import pytest

import autopart
from autopart.capture import capture
from autopart.passes import FLOPS, analyze
from autopart.passes.pipeline_split import assign_stages
from autopart.plan import PlanError
from autopart.solver import Pins, make_plan
from autopart.solver.stages import choose_stage_cuts
from tests.models import tiny_llama, token_batch

LAYERS = 6


@functools.cache
def _captured():
    captured = capture(tiny_llama(layers=LAYERS), (token_batch()[0],))
    analyze(captured.gm, captured.context())
    return captured


def _slowest_stage(captured, cuts: tuple[str, ...]) -> float:
    """The largest forward FLOPs of a stage, at the example's sizes."""
    batch = {captured.dims[name]: size for name, size in captured.dim_sizes.items()}
    per_stage = [0.0] * (len(cuts) + 1)
    for node, stage in assign_stages(captured.gm.graph, cuts).items():
        per_stage[stage] += float(FLOPS.get(node).subs(batch))
    return max(per_stage)


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_cuts_are_the_most_balanced_block_boundaries(stages):
    captured = _captured()
    cuts = choose_stage_cuts(captured.gm, stages)
    blocks = [f"model.layers.{i}" for i in range(LAYERS)]
    assert len(cuts) == stages - 1 and all(cut in blocks for cut in cuts)
    best = min(_slowest_stage(captured, c) for c in itertools.combinations(blocks, stages - 1))
    assert _slowest_stage(captured, cuts) == pytest.approx(best)


def test_more_stages_than_block_boundaries_is_a_clear_error():
    with pytest.raises(PlanError, match="6 block boundaries"):
        choose_stage_cuts(_captured().gm, LAYERS + 2)


def _plan(**pins):
    mesh = autopart.Mesh.cluster("cpu", nodes=1, per_node=2)
    return make_plan(_captured(), mesh, Pins.of(**pins))


def test_autopart_plan_takes_pipeline_pins():
    ids = token_batch(batch=8)[0]
    mesh = autopart.Mesh.cluster("cpu", nodes=1, per_node=2)
    plan = autopart.plan(tiny_llama(layers=4), mesh, (ids,), pp=2, schedule="1f1b", microbatches=4)
    assert (plan.dp, plan.pp, plan.schedule, plan.microbatches) == (1, 2, "1f1b", 4)
    assert plan.stage_cuts == ("model.layers.2",)


def test_unpinned_pipeline_choices():
    interleaved = _plan(pp=2, virtual_stages=2, microbatches=4)
    assert interleaved.schedule == "interleaved-1f1b"
    assert len(interleaved.stage_cuts) == 3
    unpinned = _plan(pp=2)  # the solver's choice: a schedule that runs, over whole rounds
    assert unpinned.schedule in ("1f1b", "interleaved-1f1b")
    assert unpinned.microbatches % 2 == 0


def test_pipeline_pins_the_schedules_cannot_run_are_refused():
    with pytest.raises(PlanError, match="interleaved-1f1b"):
        _plan(pp=2, schedule="gpipe", virtual_stages=2)
    with pytest.raises(PlanError, match="at least pp=2"):
        _plan(pp=2, schedule="1f1b", microbatches=1)


def test_recompute_takes_true_false_all_none_or_one_path():
    """`recompute=True` (or "all") recomputes every repeated block, False (or "none")
    none, and a single module path is that one block (not its characters)."""
    blocks = tuple(f"model.layers.{i}" for i in range(LAYERS))
    assert _plan(recompute=True).recompute == _plan(recompute="all").recompute == blocks
    assert _plan(recompute=False).recompute == _plan(recompute="none").recompute == ()
    assert _plan(recompute="model.layers.1").recompute == ("model.layers.1",)


def test_precision_takes_the_short_spellings_and_lists_the_accepted_ones():
    assert _plan(precision="bf16").precision == "bf16-mixed"
    assert _plan(precision="fp16").precision == "fp16-mixed"
    with pytest.raises(PlanError, match=r"precision must be one of .*'fp32'.*'bf16' for"):
        _plan(precision="half")
