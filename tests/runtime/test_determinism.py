"""The same seed and plan give bitwise-identical losses and parameters, run after run:
a difference between two runs of one plan is a bug, not rounding."""

from __future__ import annotations

import pytest
import torch

from autopart.testing import run_world
from tests.harness import train_case
from tests.models import LM_FACTORIES, token_batch

STEPS = 3
PLANS = ({"dp": 2, "zero": 1}, {"tp": 2}, {"pp": 2, "schedule": "1f1b", "microbatches": 2})


def _train(batch) -> list[dict]:
    return [train_case(LM_FACTORIES["llama"](layers=4), batch, STEPS, **pins) for pins in PLANS]


@pytest.mark.slow  # two 4-rank worlds, 20 s
def test_two_runs_of_a_plan_are_bitwise_identical():
    batch = token_batch(8)
    first, second = (run_world(_train, 2, batch) for _ in range(2))
    for rank in range(2):
        for pins, a, b in zip(PLANS, first[rank], second[rank], strict=True):
            assert a["losses"] == b["losses"], (pins, rank)
            for name, value in a["params"].items():
                assert torch.equal(value, b["params"][name]), (pins, rank, name)
