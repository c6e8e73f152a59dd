"""A learning-rate scheduler resumes from a checkpoint: saved with the parameters and
the optimizer's state under one plan and loaded under another, a warm-up cosine
schedule goes on where it stopped (instead of warming up again), and training follows
a run that never stopped."""

from __future__ import annotations

import math

import pytest
from torch.optim.lr_scheduler import LambdaLR

import autopart
from autopart.testing import run_world
from tests.harness import parallelize_lm
from tests.models import lm_loss, make_optimizer, tiny_llama, token_batch

BEFORE, AFTER = 3, 2  # steps under the first plan, then under the second
WARMUP = 2


def _warmup_cosine(step: int) -> float:
    """A linear warm-up over WARMUP steps, then a cosine down to 0 at the last step."""
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (BEFORE + AFTER - WARMUP)))


def _train(pm_or_model, optimizer, scheduler, batch, steps: int) -> tuple[list, list]:
    """`steps` steps, the scheduler stepped after each: the losses, and the rates each
    step ran at (the optimizer's groups') with the scheduler's own after its step."""
    ids, target = batch
    losses, rates = [], []
    for _ in range(steps):
        ran_at = [group["lr"] for group in optimizer.param_groups]
        if isinstance(pm_or_model, autopart.ParallelModule):
            loss = pm_or_model.train_step(ids, target)
        else:
            optimizer.zero_grad()
            loss = lm_loss(pm_or_model(ids), target)
            loss.backward()
            optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        rates.append((ran_at, scheduler.get_last_lr()))
    return losses, rates


def _resume(path: str, batch) -> dict:
    """Train under dp=2 ZeRO-1, save (with the scheduler, and once without), then load
    into tp=2 from other random weights with a fresh scheduler and train on."""
    pm = parallelize_lm(tiny_llama(seed=0), batch, dp=2, zero=1)
    scheduler = LambdaLR(pm.optimizer, _warmup_cosine)
    losses, rates = _train(pm, pm.optimizer, scheduler, batch, BEFORE)
    autopart.save_checkpoint(pm, f"{path}/with", scheduler=scheduler)
    autopart.save_checkpoint(pm, f"{path}/without")
    pm.close()

    resumed = parallelize_lm(tiny_llama(seed=1), batch, tp=2)
    fresh = LambdaLR(resumed.optimizer, _warmup_cosine)  # sets the first step's rate
    try:
        autopart.load_checkpoint(resumed, f"{path}/without", scheduler=fresh)
        refused = ""
    except autopart.CheckpointError as e:
        refused = str(e)
    autopart.load_checkpoint(resumed, f"{path}/with", scheduler=fresh)
    groups = resumed.optimizer.param_groups
    loaded = {
        "lr": [g["lr"] for g in groups],
        "initial_lr": [g["initial_lr"] for g in groups],
        "last_lr": fresh.get_last_lr(),
        "epoch": fresh.last_epoch,
    }
    more_losses, more_rates = _train(resumed, resumed.optimizer, fresh, batch, AFTER)
    resumed.close()
    return {
        "losses": losses + more_losses,
        "rates": rates + more_rates,
        "loaded": loaded,
        "refused": refused,
    }


def _uninterrupted(batch) -> dict:
    """The reference: one device, the same optimizer and schedule, never stopped."""
    model = tiny_llama(seed=0)
    optimizer = make_optimizer("adamw")(model.parameters())
    scheduler = LambdaLR(optimizer, _warmup_cosine)
    losses, rates = _train(model, optimizer, scheduler, batch, BEFORE + AFTER)
    return {"losses": losses, "rates": rates}


@pytest.mark.slow  # a world of 2 resumed twice; the finetune example resumes a schedule quick
def test_a_warmup_cosine_schedule_resumes_under_another_plan(tmp_path):
    batch = token_batch(8)
    per_rank = run_world(_resume, 2, str(tmp_path), batch)
    reference = _uninterrupted(batch)
    base = 1e-3  # make_optimizer's AdamW
    for rank, result in enumerate(per_rank):
        assert "holds no learning-rate scheduler's state" in result["refused"], rank
        # The groups' rates after loading are the ones the saved scheduler last set,
        # over the base rate the first scheduler started from.
        loaded = result["loaded"]
        assert loaded["lr"] == loaded["last_lr"] == reference["rates"][BEFORE - 1][1], rank
        assert loaded["initial_lr"] == [base], rank
        assert loaded["epoch"] == BEFORE, rank
        assert result["rates"] == reference["rates"], rank  # exactly, step by step
        assert result["losses"] == pytest.approx(reference["losses"], rel=1e-5), rank
    # A warm-up started again would run the first resumed step at another rate.
    assert reference["rates"][BEFORE][0] != [base * _warmup_cosine(0)]
