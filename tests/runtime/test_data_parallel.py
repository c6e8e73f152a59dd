"""Data parallelism trains to the single-device losses and parameters (fp32, Gloo)."""

from __future__ import annotations

import pytest
import torch

import autopart
from autopart.testing import run_world
from tests.models import (
    LM_FACTORIES,
    assert_matches,
    lm_loss,
    make_optimizer,
    snapshot,
    token_batch,
    train_single_device,
)

STEPS = 5
CASES = [(m, o) for m in ("gpt2", "llama") for o in ("sgd", "adamw")]


def _train_dp(cases, batch) -> dict:
    ids, target = batch
    results = {}
    for model_name, optimizer in cases:
        model = LM_FACTORIES[model_name]()
        pm = autopart.parallelize(
            model,
            autopart.Mesh.local(),
            (ids,),
            loss_fn=lm_loss,
            optimizer=make_optimizer(optimizer),
            dp=torch.distributed.get_world_size(),
            zero=0,
        )
        losses = [pm.train_step(ids, target).item() for _ in range(STEPS)]
        pm.close()
        results[(model_name, optimizer)] = {
            "losses": losses,
            "params": snapshot(model),
        }
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_dp_matches_single_device(world):
    batch = token_batch(batch=8)
    per_rank = run_world(_train_dp, world, CASES, batch)
    for case in CASES:
        reference = train_single_device(*case, STEPS, batch)
        for rank, results in enumerate(per_rank):
            try:
                assert_matches(results[case], reference)
            except AssertionError as e:
                raise AssertionError(f"{case} rank {rank} of {world}: {e}") from e


def test_batch_not_divisible_by_dp_is_a_clear_error():
    ids, _ = token_batch(batch=6)
    mesh = autopart.Mesh.cluster("cpu", nodes=1, per_node=4)
    with pytest.raises(autopart.BatchError) as info:
        autopart.plan(LM_FACTORIES["llama"](), mesh, (ids,), dp=4)
    message = str(info.value)
    assert "6" in message and "dp=4" in message and "multiple of 4" in message
