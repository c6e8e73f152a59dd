"""Activation recomputation: the plan's blocks save only their inputs and train to the
same losses and parameters as one device, under ZeRO-3 too."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
from torch.autograd.graph import saved_tensors_hooks

from autopart.ops.zero3 import sharded_parameters
from autopart.passes import zero
from autopart.testing import run_world
from tests.harness import case_key, train_case
from tests.models import LM_FACTORIES, assert_matches, lm_loss, token_batch, train_single_device

STEPS = 5
EVERY_LAYER = {
    "gpt2": ("transformer.h.0", "transformer.h.1"),
    "llama": ("model.layers.0", "model.layers.1"),
}
# The quick suite recomputes one model under dp; the slow sweeps the others and tp.
CASES = [("llama", {"dp": 2})]
MORE_CASES = [("gpt2", {"dp": 2}), ("llama", {"tp": 2})]


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


def _train(batch, cases):
    report = functools.partial(_recompute_report, batch[0])
    return {
        case_key(name, pins): {
            bool(recompute): train_case(
                LM_FACTORIES[name](), batch, STEPS, inspect=report, recompute=recompute, **pins
            )
            for recompute in ((), EVERY_LAYER[name])
        }
        for name, pins in cases
    }


@pytest.mark.slow  # the quick suite recomputes blocks under ZeRO-3, below
@pytest.mark.parametrize("cases", [CASES, MORE_CASES])
def test_recomputed_blocks_save_less_and_train_the_same(cases):
    batch = token_batch(8)
    results = run_world(_train, 2, batch, cases)[0]
    for name, pins in cases:
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


SELECTIVE_CASES = [("llama-eager", {"tp": 2})]
MORE_SELECTIVE_CASES = [("gpt2-eager", {"dp": 2})]
HEADS = 4


def _train_selective(batch, cases):
    report = functools.partial(_recompute_report, batch[0])
    return {
        case_key(name, pins): {
            recompute: train_case(
                LM_FACTORIES[name](), batch, STEPS, inspect=report, recompute=recompute, **pins
            )
            for recompute in ("none", "attention")
        }
        for name, pins in cases
    }


@pytest.mark.slow  # the quick suite recomputes blocks under ZeRO-3, below
@pytest.mark.parametrize("cases", [SELECTIVE_CASES, MORE_SELECTIVE_CASES])
def test_recomputed_attention_cores_free_the_scores_and_train_the_same(cases):
    """Selective recomputation (the attention core alone) on models whose attention is
    written out: each layer's softmax probabilities are no longer saved, and training
    matches one device."""
    ids, target = batch = token_batch(8)
    results = run_world(_train_selective, 2, batch, cases)[0]
    for name, pins in cases:
        plain, selective = (results[case_key(name, pins)][r] for r in ("none", "attention"))
        assert plain["outlined"] == 0 and selective["outlined"] == 2
        # Per layer, this rank's probabilities: its batch × its heads × seq² fp32 values.
        batch_here, heads_here = ids.shape[0] // pins.get("dp", 1), HEADS // pins.get("tp", 1)
        probabilities = batch_here * heads_here * ids.shape[1] ** 2 * 4
        assert selective["saved"] <= plain["saved"] - 2 * probabilities, (name, pins)
        assert_matches(selective, train_single_device(name, "adamw", STEPS, batch))


# Each block of the tiny models spans several ZeRO-3 buckets at this cap (bytes), as a
# large model's blocks do at the policy's.
SMALL_BUCKETS = 40_000
ZERO3_CASES = [("llama", {"recompute": ("model.layers.1",)})]
MORE_ZERO3_CASES = [
    ("llama", {"recompute": EVERY_LAYER["llama"]}),
    ("llama-eager", {"recompute": "attention"}),
]


def _zero3_report(batch, pm) -> dict:
    """One more step, counting each bucket's gathers, and what the stage held gathered."""
    zero3 = sharded_parameters(pm.graph)
    gathers: Counter[int] = Counter()
    start = zero3.start_gather

    def counted(bucket: int):
        gathers[bucket] += 1
        return start(bucket)

    zero3.start_gather = counted
    pm.train_step(*batch)
    blocks: Counter[str] = Counter()  # gathered bytes of each block's buckets
    for names, layout in zip(zero3.names, zero3.layouts):
        block = names[0].split(".")[:3]
        blocks[".".join(block)] += layout.padded * 4 if block[1] == "layers" else 0
    return {
        "gathers": [gathers[b] for b in range(len(zero3.layouts))],
        "buckets": [".".join(names[0].split(".")[:3]) for names in zero3.names],
        "gathered_with": zero3.gathered_with,
        "peak_gathered": zero3.peak_gathered_bytes,
        "gathered_after_step": zero3.gathered_bytes(),
        "largest_block": max(blocks.values()),
        "outlined": sum(1 for n, _ in pm.graph.named_children() if "recompute" in n),
    }


def _train_zero3(batch, cases):
    zero.ZERO3_BUCKET_BYTES = SMALL_BUCKETS  # this rank's process only
    report = functools.partial(_zero3_report, batch)
    return {
        case_key(name, pins): train_case(
            LM_FACTORIES[name](), batch, STEPS, inspect=report, dp=2, zero=3, **pins
        )
        for name, pins in cases
    }


@pytest.mark.parametrize(
    "cases", [ZERO3_CASES, pytest.param(MORE_ZERO3_CASES, marks=pytest.mark.slow)]
)
def test_zero3_gathers_a_recomputed_block_again_and_trains_the_same(cases):
    """Under ZeRO-3 a recomputed block (every block, one, or the attention cores alone)
    leaves its gathered parameters to backward as tokens: its recomputation gathers its
    buckets again, all at once, and that is backward's gather, not a third. At most two
    blocks are held gathered (the memory model's ZeRO-3 buffer), none after the step,
    and training matches one device."""
    batch = token_batch(8)
    results = run_world(_train_zero3, 2, batch, cases)[0]
    for name, pins in cases:
        got = results[case_key(name, pins)]
        recomputed = pins["recompute"] if pins["recompute"] != "attention" else ()
        mine = {b for b, block in enumerate(got["buckets"]) if block in recomputed}
        assert len(mine) > len(recomputed) or not recomputed, "blocks span several buckets"
        assert {b for b, others in enumerate(got["gathered_with"]) if others} == mine
        assert all(n in (1, 2) for n in got["gathers"]), got["gathers"]
        assert all(got["gathers"][b] == 2 for b in mine)
        assert 0 < got["peak_gathered"] <= 2 * got["largest_block"]
        assert got["gathered_after_step"] == 0
        assert got["outlined"] == (len(recomputed) or 2), (name, pins)
        assert_matches(got, train_single_device(name, "adamw", STEPS, batch))
