"""Every axis at once: DP2 × TP2 × PP2 with ZeRO-2 on 8 Gloo processes trains tiny
GPT-2 and Llama to the single-device losses and parameters (fp32, 5 AdamW steps)."""

from __future__ import annotations

import pytest

from autopart.testing import run_world
from tests.harness import assert_every_rank_matches, train_case
from tests.models import LM_FACTORIES, token_batch, train_single_device

STEPS = 5
LAYERS = 4
PINS = {"dp": 2, "tp": 2, "pp": 2, "zero": 2, "schedule": "1f1b", "microbatches": 2}


def _collective_axes(pm) -> dict:
    return {"axes": {info.axis for _, info in pm.collectives()}}


def _train(batch):
    return {
        name: train_case(
            LM_FACTORIES[name](layers=LAYERS), batch, STEPS, inspect=_collective_axes, **PINS
        )
        for name in ("gpt2", "llama")
    }


@pytest.mark.slow  # kept out of the quick suite's 10 minutes; CI runs it
def test_dp2_tp2_pp2_zero2_matches_single_device():
    batch = token_batch(8)
    per_rank = run_world(_train, 8, batch)
    for name in ("gpt2", "llama"):
        reference = train_single_device(name, "adamw", STEPS, batch, layers=LAYERS)
        assert_every_rank_matches(per_rank, name, reference)
        assert "tp" in per_rank[0][name]["axes"]
