"""Property-based equivalence, a small profile: random models (residual and plain MLPs,
attention, RMS norms, tied weights, widths that tp does not divide) under random pins
either train like one device or are refused with a reason. `benchmarks/
equivalence_sweep.py` runs the same strategy over hundreds of cases."""

from __future__ import annotations

import pytest

from autopart.testing import run_world
from tests.random_models import Case, drawn, outcome, reference, run_cases


@pytest.mark.parametrize("count", [4, pytest.param(12, marks=pytest.mark.slow)])
def test_random_models_under_random_pins_match_one_device_or_are_refused(count):
    cases = drawn(count)
    outcomes = []
    for world in sorted({c.world for c in cases}):
        group = [c for c in cases if c.world == world]
        per_rank = run_world(run_cases, world, group)
        for i, case in enumerate(group):
            want = reference(case)
            verdicts = {outcome(results[i], want) for results in per_rank}
            outcomes.append((case, verdicts))
    failed = [(c, v) for c, v in outcomes if v - {"pass", "refused"}]
    assert not failed, failed
    assert any(v == {"pass"} for _, v in outcomes)  # the profile exercises some plans


@pytest.mark.slow  # a 4-rank world; the random sweep above crosses stage cuts too
def test_a_row_parallel_output_crossing_a_stage_cut_trains_like_one_device():
    """Found by the sweep: a block without a residual ends in a row-parallel product,
    whose reduced output and bias add (nodes the tp rewrite inserts, with no traced
    value) are what crosses the pipeline cut, and must carry their gradient back."""
    case = Case(
        width=16,
        vocab=16,
        blocks=("attention", "plain_mlp", "plain_mlp"),
        tied=False,
        pins=(("dp", 1), ("pp", 2), ("tp", 2)),
        seed=16207,
    )
    want = reference(case)
    assert {outcome(r[0], want) for r in run_world(run_cases, 4, [case])} == {"pass"}


@pytest.mark.slow  # a 4-rank world
def test_a_stack_of_unlike_layers_is_cut_into_pipeline_stages():
    """The main stack's layers are cut points whether or not they are copies: attention,
    MLP and norm layers at pp=2 train like one device."""
    case = Case(
        width=8,
        vocab=16,
        blocks=("attention", "mlp", "rms_norm"),
        tied=True,
        pins=(("dp", 1), ("pp", 2), ("tp", 1)),
        seed=3,
    )
    want = reference(case)
    assert {outcome(r[0], want) for r in run_world(run_cases, 2, [case])} == {"pass"}
