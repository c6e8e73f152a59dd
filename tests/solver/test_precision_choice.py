"""`precision="bf16-auto"`: the solver plans both 16-bit modes, autocast over fp32
weights ("bf16-mixed") and 16-bit parameters ("bf16-params"), and keeps one; the plan
says which and why. On the meta device."""

from __future__ import annotations

import pytest

import autopart
from autopart.plan import Plan, PlanError
from tests.solver.test_param_dtype_plans import IDS, MESH, _llama


def _auto(**pins: object) -> Plan:
    return autopart.plan(_llama(), MESH, (IDS,), precision="bf16-auto", dp=8, **pins)


def test_sixteen_bit_parameters_where_they_are_faster_and_fit() -> None:
    plan = _auto()
    assert plan.precision == "bf16-params"
    assert plan.zero >= 1  # where dp > 1 its masters are sharded
    assert plan.predicted is not None
    assert plan.predicted.peak_memory_bytes <= MESH.device.memory_bytes
    # The reason weighs the bf16-mixed plan, slower by more than the slack.
    assert "the bf16-mixed plan at" in plan.precision_reason
    assert "slower by more than 5%" in plan.precision_reason
    text = plan.explain()
    assert "the solver's choice among the modes" in text
    assert "As chosen (see above), the model itself computes in bf16" in text
    assert "(the solver chose it)" in str(plan)
    # Priced eager on a GPU preset, which leaves out the eager runtime's dispatch.
    assert "which the preset does not price" in text


@pytest.mark.parametrize(
    ("pins", "says"),
    [
        ({"zero": 3, "offload": True}, "does not combine with offload"),
        ({"zero": 0}, "use zero=1, 2 or 3"),
    ],
)
def test_autocast_where_sixteen_bit_parameters_are_refused(pins: dict, says: str) -> None:
    plan = _auto(**pins)
    assert plan.precision == "bf16-mixed"
    assert "bf16-params has no plan here" in plan.precision_reason
    assert says in plan.precision_reason
    assert says in plan.explain()


def test_the_choice_round_trips(tmp_path) -> None:
    plan = _auto(zero=0)
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert (loaded.precision, loaded.precision_reason) == ("bf16-mixed", plan.precision_reason)


def test_a_reduce_dtype_no_mode_takes_is_refused() -> None:
    with pytest.raises(PlanError, match="reduce_dtype must be one of"):
        _auto(zero=3, reduce_dtype="fp16")


def test_an_unknown_precision_names_the_choice() -> None:
    with pytest.raises(PlanError, match="'bf16-auto', the solver's choice"):
        autopart.plan(_llama(), MESH, (IDS,), precision="bf16-automatic")
