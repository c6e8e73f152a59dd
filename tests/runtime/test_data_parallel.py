"""Data parallelism trains to the single-device losses and parameters (fp32, Gloo)."""

from __future__ import annotations

import pytest
import torch

import autopart
from autopart.testing import run_world
from tests.harness import (
    assert_every_rank_matches,
    case_key,
    parallelize_lm,
    slow_links_cpu,
    train_case,
    train_losses,
)
from tests.models import LM_FACTORIES, snapshot, token_batch, train_single_device

STEPS = 5
# The quick suite runs each model with one optimizer; the slow, every pair on 4 ranks too.
CASES = [("gpt2", "sgd"), ("llama", "adamw")]
MORE_CASES = [("gpt2", "adamw"), ("llama", "sgd")]


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


@pytest.mark.parametrize(
    "world, cases",
    [
        (2, CASES),
        pytest.param(2, MORE_CASES, marks=pytest.mark.slow),
        pytest.param(4, CASES + MORE_CASES, marks=pytest.mark.slow),
    ],
)
def test_dp_matches_single_device(world, cases):
    batch = token_batch(batch=8)
    per_rank = run_world(_train_dp, world, cases, batch)
    for case in cases:
        assert_every_rank_matches(per_rank, case, train_single_device(*case, STEPS, batch))


def _train_free(batch, device) -> dict:
    def plan_of(pm) -> dict:
        return {"plan": (pm.plan.tp, pm.plan.dp, pm.plan.tp_shards_nothing)}

    return train_case(LM_FACTORIES["gpt2"](), batch, STEPS, "sgd", plan_of, device)


def test_ranks_that_each_run_the_whole_step_match_single_device():
    """Where links are slow, the free plan of a tiny GPT-2 on 2 ranks is a tp that
    shards nothing: each rank runs the whole step on the whole batch, with no
    collective. Each then trains its own copy of the weights as one device would, with
    SGD, whose update shows any gradient scaled by a rank count."""
    batch = token_batch(batch=8)
    per_rank = run_world(_train_free, 2, batch, slow_links_cpu())
    assert [r.pop("plan") for r in per_rank] == [(2, 1, True)] * 2
    reference = train_single_device("gpt2", "sgd", STEPS, batch)
    assert_every_rank_matches([{"free": r} for r in per_rank], "free", reference)


ACCUMULATED = [("llama", {"dp": 2, "microbatches": 2, "zero": 2})]
MORE_ACCUMULATED = [("llama", {"dp": 2, "microbatches": 2, "zero": 0})]


def _train_accumulated(batch, cases) -> dict:
    return {
        case_key(name, pins): train_case(LM_FACTORIES[name](), batch, STEPS, "sgd", **pins)
        for name, pins in cases
    }


@pytest.mark.slow  # test_ignored_tokens.py's quick case accumulates at dp=2
@pytest.mark.parametrize("cases", [ACCUMULATED, MORE_ACCUMULATED])
def test_gradient_accumulation_matches_single_device(cases):
    """Microbatches without a pipeline (the solver's gradient accumulation) sum the
    microbatches' gradients into one step: SGD, whose update scales with the gradient,
    would show a wrong scale."""
    batch = token_batch(batch=8)
    per_rank = run_world(_train_accumulated, 2, batch, cases)
    reference = train_single_device("llama", "sgd", STEPS, batch)
    for name, pins in cases:
        assert_every_rank_matches(per_rank, case_key(name, pins), reference)


def test_batch_not_divisible_by_dp_is_a_clear_error():
    ids, _ = token_batch(batch=6)
    mesh = autopart.Mesh.cluster("cpu", nodes=1, per_node=4)
    with pytest.raises(autopart.BatchError) as info:
        autopart.plan(LM_FACTORIES["llama"](), mesh, (ids,), dp=4)
    message = str(info.value)
    assert "6" in message and "dp=4" in message and "multiple of 4" in message
