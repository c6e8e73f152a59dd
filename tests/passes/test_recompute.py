"""Activation recomputation: the plan's blocks save only their inputs and train to the
same losses and parameters as one device."""

from __future__ import annotations

import functools

import pytest
from torch.autograd.graph import saved_tensors_hooks

import autopart
from autopart.testing import run_world
from tests.harness import case_key, train_case
from tests.models import LM_FACTORIES, assert_matches, lm_loss, token_batch, train_single_device

STEPS = 5
EVERY_LAYER = {
    "gpt2": ("transformer.h.0", "transformer.h.1"),
    "llama": ("model.layers.0", "model.layers.1"),
}
CASES = [("gpt2", {"dp": 2}), ("llama", {"dp": 2}), ("llama", {"tp": 2})]


def _saved_bytes(pm, ids) -> int:
    """Bytes autograd keeps for backward in one forward of this rank's program."""
    total = 0

    def pack(t):
        nonlocal total
        if not (t.requires_grad and t.grad_fn is None):  # parameters are not activations
            total += t.numel() * t.element_size()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        lm_loss(pm(pm.local_batch((ids,))[0]), ids[: ids.shape[0] // pm.plan.dp])
    return total


def _recompute_report(ids, pm) -> dict:
    # Activation sizes depend on shapes only, so measuring after training is as good as
    # before it.
    return {
        "saved": _saved_bytes(pm, ids),
        "outlined": sum(1 for n, _ in pm.graph.named_children() if "recompute" in n),
    }


def _train(batch):
    report = functools.partial(_recompute_report, batch[0])
    return {
        case_key(name, pins): {
            bool(recompute): train_case(
                LM_FACTORIES[name](), batch, STEPS, inspect=report, recompute=recompute, **pins
            )
            for recompute in ((), EVERY_LAYER[name])
        }
        for name, pins in CASES
    }


def test_recomputed_blocks_save_less_and_train_the_same():
    batch = token_batch(8)
    results = run_world(_train, 2, batch)[0]
    for name, pins in CASES:
        by_recompute = results[case_key(name, pins)]
        plain, recomputed = by_recompute[False], by_recompute[True]
        assert recomputed["outlined"] == 2 and plain["outlined"] == 0
        # Two of the model's blocks keep only their inputs; the head's logits remain.
        assert recomputed["saved"] < 0.6 * plain["saved"], (
            name,
            pins,
            recomputed["saved"],
            plain["saved"],
        )
        assert_matches(recomputed, train_single_device(name, "adamw", STEPS, batch))


SELECTIVE_CASES = [("gpt2-eager", {"dp": 2}), ("llama-eager", {"tp": 2})]
HEADS = 4


def _train_selective(batch):
    report = functools.partial(_recompute_report, batch[0])
    return {
        case_key(name, pins): {
            recompute: train_case(
                LM_FACTORIES[name](), batch, STEPS, inspect=report, recompute=recompute, **pins
            )
            for recompute in ("none", "attention")
        }
        for name, pins in SELECTIVE_CASES
    }


def test_recomputed_attention_cores_free_the_scores_and_train_the_same():
    """Selective recomputation (the attention core alone) on models whose attention is
    written out: each layer's softmax probabilities are no longer saved, and training
    matches one device."""
    ids, target = batch = token_batch(8)
    results = run_world(_train_selective, 2, batch)[0]
    for name, pins in SELECTIVE_CASES:
        plain, selective = (results[case_key(name, pins)][r] for r in ("none", "attention"))
        assert plain["outlined"] == 0 and selective["outlined"] == 2
        # Per layer, this rank's probabilities: its batch × its heads × seq² fp32 values.
        batch_here, heads_here = ids.shape[0] // pins.get("dp", 1), HEADS // pins.get("tp", 1)
        probabilities = batch_here * heads_here * ids.shape[1] ** 2 * 4
        assert selective["saved"] <= plain["saved"] - 2 * probabilities, (name, pins)
        assert_matches(selective, train_single_device(name, "adamw", STEPS, batch))


def test_recompute_with_zero3_is_refused():
    mesh = autopart.Mesh.cluster("cpu", nodes=1, per_node=2)
    with pytest.raises(autopart.PlanError, match="ZeRO-3"):
        autopart.plan(
            LM_FACTORIES["llama"](),
            mesh,
            (token_batch(4)[0],),
            zero=3,
            recompute=EVERY_LAYER["llama"],
        )
