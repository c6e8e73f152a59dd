"""Every axis at once: DP2 × TP2 × PP2 with ZeRO-2 on 8 Gloo processes trains tiny
GPT-2 and Llama to the single-device losses and parameters (fp32, 5 AdamW steps)."""

from __future__ import annotations

import autopart
from autopart.testing import run_world
from tests.models import (
    LM_FACTORIES,
    assert_matches,
    lm_loss,
    make_optimizer,
    token_batch,
    train_single_device,
)

STEPS = 5
LAYERS = 4
PINS = {"dp": 2, "tp": 2, "pp": 2, "zero": 2, "schedule": "1f1b", "microbatches": 2}


def _train(batch):
    ids, target = batch
    out = {}
    for name in ("gpt2", "llama"):
        pm = autopart.parallelize(
            LM_FACTORIES[name](layers=LAYERS),
            autopart.Mesh.local(),
            (ids,),
            loss_fn=lm_loss,
            optimizer=make_optimizer("adamw"),
            **PINS,
        )
        losses = [pm.train_step(ids, target).item() for _ in range(STEPS)]
        out[name] = {
            "losses": losses,
            "params": pm.full_state_dict(),
            "axes": {info.axis for _, info in pm.collectives()},
        }
        pm.close()
    return out


def test_dp2_tp2_pp2_zero2_matches_single_device():
    batch = token_batch(8)
    per_rank = run_world(_train, 8, batch)
    for name in ("gpt2", "llama"):
        reference = train_single_device(name, "adamw", STEPS, batch, layers=LAYERS)
        for rank, results in enumerate(per_rank):
            try:
                assert_matches(results[name], reference)
            except AssertionError as e:
                raise AssertionError(f"{name} rank {rank}: {e}") from e
        assert "tp" in per_rank[0][name]["axes"]
