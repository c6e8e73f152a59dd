"""What a user reads back from a parallelized model: `forward`'s numbers under each
axis, and a checkpoint saved from sharded parameters. Slow: run by `.ci/run`."""

from __future__ import annotations

import pytest
import torch

import autopart
from autopart.testing import run_world
from tests.harness import parallelize_lm, train_losses
from tests.models import LM_FACTORIES, tiny_llama, token_batch

pytestmark = pytest.mark.slow

FORWARD = [{"dp": 2}, {"tp": 2}, {"dp": 2, "zero": 3}]


def _forward(batch) -> dict:
    ids, _ = batch
    out = {}
    for pins in FORWARD:
        pm = parallelize_lm(LM_FACTORIES["llama"](), batch, **pins)
        local = pm.local_batch((ids,))[0]
        pm.eval()
        with torch.no_grad():
            logits = pm(local)
        out[tuple(pins.items())] = (local, getattr(logits, "logits", logits), pm.training)
        pm.close()
    return out


def test_forward_gives_the_models_outputs_for_this_ranks_samples():
    batch = token_batch(8)
    reference = LM_FACTORIES["llama"]()
    for results in run_world(_forward, 2, batch):
        for pins in FORWARD:
            local, logits, training = results[tuple(pins.items())]
            assert not training
            with torch.no_grad():
                expected = reference(local).logits
            torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5, msg=str(pins))


def _save_sharded_then_load(checkpoint_dir, batch) -> dict:
    """Train a step under tp=2 with ZeRO-3 over dp=2 (every parameter sharded), save,
    and load the checkpoint into a meta-device model planned differently (tp=4)."""
    trained = parallelize_lm(tiny_llama(), batch, dp=2, tp=2, zero=3)
    train_losses(trained, batch, 1)
    autopart.save_checkpoint(trained, checkpoint_dir)
    saved = trained.full_state_dict()
    with autopart.init_empty_weights():
        model = tiny_llama()
    loaded = parallelize_lm(model, batch, tp=4, weights=checkpoint_dir)
    return {"saved": saved, "loaded": loaded.full_state_dict()}


def test_a_checkpoint_saved_from_sharded_parameters_loads_under_another_plan(tmp_path):
    for result in run_world(_save_sharded_then_load, 4, str(tmp_path / "ckpt"), token_batch(8)):
        assert result["loaded"].keys() == result["saved"].keys()
        for name, tensor in result["saved"].items():
            assert result["loaded"][name].equal(tensor), name
