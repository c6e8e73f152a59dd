"""cp × tp with sequence parallelism on a model that reads its positions from a table
(GPT-2's learned `wpe(arange(seq))`) would give each token another token's position:
cp's mirrored chunks and sequence parallelism's slice compose in the opposite order
for the table from the tokens'. autopart refuses it pinned and leaves sequence
parallelism off where the solver chooses; a rotary model (Llama) is unaffected."""

from __future__ import annotations

import functools

import pytest

import autopart
from autopart.api import captured_for_planning
from autopart.passes.context_parallel import position_tables
from autopart.plan import PlanError
from autopart.solver import Pins, make_plan
from tests.models import tiny_gpt2, tiny_llama, token_batch

MESH = autopart.Mesh.cluster("cpu", nodes=1, per_node=4)


@functools.cache
def _captured(model: str):
    ids, _ = token_batch(4, 8)
    return captured_for_planning(tiny_gpt2() if model == "gpt2" else tiny_llama(), (ids,))


def _plan(model: str, **pins):
    return make_plan(_captured(model), MESH, Pins.of(**pins))


def test_the_position_table_is_found_by_its_reads():
    gpt2, llama = _captured("gpt2"), _captured("llama")
    assert position_tables(gpt2.gm, gpt2.parameter_names) == ["transformer.wpe.weight"]
    assert position_tables(llama.gm, llama.parameter_names) == []


def test_pinned_sequence_parallelism_under_cp_is_refused_on_a_position_table():
    with pytest.raises(PlanError, match=r"sequence parallelism.*sequence_parallel=False"):
        _plan("gpt2", cp=2, tp=2, sequence_parallel=True)
    with pytest.raises(PlanError, match=r"sequence parallelism.*transformer\.wpe\.weight"):
        _plan("gpt2", cp=2, sequence_parallel=True)


def test_the_solver_leaves_sequence_parallelism_off_under_cp_on_a_position_table():
    plan = _plan("gpt2", cp=2, tp=2)
    assert (plan.cp, plan.tp) == (2, 2)
    assert not plan.sequence_parallel
    assert not any(
        a.sequence_parallel and a.degrees.cp > 1 and a.degrees.tp > 1 for a in plan.alternatives
    )
    assert _plan("gpt2", cp=1, tp=2, sequence_parallel=True).sequence_parallel


def test_a_rotary_model_keeps_sequence_parallelism_under_cp():
    plan = _plan("llama", cp=2, tp=2, sequence_parallel=True)
    assert (plan.cp, plan.tp) == (2, 2) and plan.sequence_parallel


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_a_candidate_the_search_runs_sequence_parallel_under_cp_is_kept_correct(model):
    """Where the solver's layout model would choose sequence parallelism under cp × tp
    (a larger model than these), the candidate runs without it on a position table, is
    dropped where it is pinned on, and is kept as it is on a rotary model."""
    from dataclasses import replace

    from autopart.solver.pins import _positions_kept
    from autopart.solver.search import TpLayouts, search

    captured = _captured(model)
    dims = {k: v for k, v in captured.dim_sizes.items() if k != "batch"}
    layouts = TpLayouts(captured.gm, captured.parameter_names, MESH, dims)
    found = search(layouts, MESH, Pins.of(cp=2, tp=2), 4, dims)
    on = [replace(c, choices=replace(c.choices, sequence_parallel=True)) for c in found]
    kept = _positions_kept(on, Pins.of(cp=2, tp=2), layouts)
    assert len(kept) == len(on)
    assert all(c.choices.sequence_parallel == (model == "llama") for c in kept)
    if model == "gpt2":
        with pytest.raises(PlanError, match="sequence parallelism"):
            _positions_kept(on, Pins.of(cp=2, tp=2, sequence_parallel=True), layouts)
