"""cp × tp with sequence parallelism plans on a model that reads its positions from a
table (GPT-2's learned `wpe(arange(seq))`) as on a rotary one (Llama): the cp walk cuts
the table's lookup as the tokens are cut, cp's mirrored chunks first and sequence
parallelism's slice of them second (`tp_rules._sequence_parallel_slice`; the 4-rank
run against one device is `tests/runtime/test_context_parallel.py`'s)."""

from __future__ import annotations

import pytest

import autopart
from autopart.api import captured_for_planning
from autopart.solver import Pins, make_plan
from tests.models import tiny_gpt2, tiny_llama, token_batch

MESH = autopart.Mesh.cluster("cpu", nodes=1, per_node=4)


@pytest.mark.parametrize("model", [tiny_gpt2, tiny_llama])
def test_sequence_parallelism_under_cp_plans_with_learned_or_rotary_positions(model):
    ids, _ = token_batch(4, 8)
    captured = captured_for_planning(model(), (ids,))
    plan = make_plan(captured, MESH, Pins.of(cp=2, tp=2, sequence_parallel=True))
    assert (plan.cp, plan.tp) == (2, 2) and plan.sequence_parallel
