"""Data parallelism trains to the single-device losses and parameters (fp32, Gloo)."""

from __future__ import annotations

import pytest
import torch

import autopart
from autopart.testing import run_world
from tests.harness import assert_every_rank_matches, parallelize_lm, train_losses
from tests.models import LM_FACTORIES, snapshot, token_batch, train_single_device

STEPS = 5
CASES = [(m, o) for m in ("gpt2", "llama") for o in ("sgd", "adamw")]


def _train_dp(cases, batch) -> dict:
    results = {}
    for model_name, optimizer in cases:
        model = LM_FACTORIES[model_name]()
        pm = parallelize_lm(model, batch, optimizer, dp=torch.distributed.get_world_size(), zero=0)
        losses = train_losses(pm, batch, STEPS)
        pm.close()
        # Replicated parameters are trained in place: the user's model is the result.
        results[(model_name, optimizer)] = {"losses": losses, "params": snapshot(model)}
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_dp_matches_single_device(world):
    batch = token_batch(batch=8)
    per_rank = run_world(_train_dp, world, CASES, batch)
    for case in CASES:
        assert_every_rank_matches(per_rank, case, train_single_device(*case, STEPS, batch))


def test_batch_not_divisible_by_dp_is_a_clear_error():
    ids, _ = token_batch(batch=6)
    mesh = autopart.Mesh.cluster("cpu", nodes=1, per_node=4)
    with pytest.raises(autopart.BatchError) as info:
        autopart.plan(LM_FACTORIES["llama"](), mesh, (ids,), dp=4)
    message = str(info.value)
    assert "6" in message and "dp=4" in message and "multiple of 4" in message
