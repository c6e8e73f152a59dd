"""Pipeline parallelism trains to the single-device losses and parameters (fp32, Gloo).

Several plans share one spawned world, to pay the start-up once. GPT-2 ties its input
embedding to its output head, so its first and last stages share a parameter (on
different ranks): that exercises the replica exchange.
"""

from __future__ import annotations

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

WORLD_2 = [  # (name, model, layers, pins)
    ("gpt2 PP2 GPipe", "gpt2", 4, dict(pp=2, schedule="gpipe", microbatches=2)),
    ("gpt2 PP2 1F1B", "gpt2", 4, dict(pp=2, schedule="1f1b", microbatches=4)),
    ("llama PP2 GPipe", "llama", 4, dict(pp=2, schedule="gpipe", microbatches=4)),
    ("llama PP2 1F1B", "llama", 4, dict(pp=2, schedule="1f1b", microbatches=2)),
]
# 8 stages (pp=4 × 2 virtual) need 8 layers: one block per stage, the embedding with the
# first and the head with the last.
INTERLEAVED = dict(pp=4, schedule="interleaved-1f1b", virtual_stages=2, microbatches=4)
WORLD_4 = [
    ("gpt2 PP4 interleaved", "gpt2", 8, INTERLEAVED),
    ("llama PP4 interleaved", "llama", 8, INTERLEAVED),
    ("gpt2 TP2×PP2 1F1B", "gpt2", 4, dict(tp=2, pp=2, schedule="1f1b", microbatches=2)),
    ("llama TP2×PP2 1F1B", "llama", 4, dict(tp=2, pp=2, schedule="1f1b", microbatches=2)),
]


def _train_pipelined(cases, batch) -> dict:
    ids, target = batch
    results = {}
    for name, model_name, layers, pins in cases:
        model = LM_FACTORIES[model_name](layers=layers)
        pm = autopart.parallelize(
            model,
            autopart.Mesh.local(),
            (ids,),
            loss_fn=lm_loss,
            optimizer=make_optimizer("adamw"),
            **pins,
        )
        losses = [pm.train_step(ids, target).item() for _ in range(STEPS)]
        full = pm.full_state_dict()
        pm.close()
        assert full.keys() == dict(model.named_parameters()).keys(), name
        trained = LM_FACTORIES[model_name](layers=layers)
        trained.load_state_dict(full, strict=False)  # tied and non-persistent ones aside
        results[name] = {"losses": losses, "params": snapshot(trained)}
    return results


def _check(cases, world: int) -> None:
    batch = token_batch(batch=8)
    per_rank = run_world(_train_pipelined, world, cases, batch)
    for name, model_name, layers, _ in cases:
        reference = train_single_device(model_name, "adamw", STEPS, batch, layers=layers)
        for rank, results in enumerate(per_rank):
            try:
                assert_matches(results[name], reference)
            except AssertionError as e:
                raise AssertionError(f"{name}, rank {rank} of {world}: {e}") from e


def test_two_stage_schedules_match_single_device():
    _check(WORLD_2, 2)


def test_interleaved_and_composed_pipelines_match_single_device():
    _check(WORLD_4, 4)
