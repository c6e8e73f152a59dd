"""ZeRO-1, -2 and -3 train to the single-device losses and parameters (fp32, 5 AdamW
steps, Gloo), with a pipeline, and ZeRO-3 with recomputation under tp and pp; ZeRO-3
holds 1/N of the model states. One world of 4 runs every case
(slow: the quick suite trains ZeRO-1 to -3 on worlds of 2 in test_master_weights.py,
test_offload.py, test_checkpoint.py and below). ZeRO-1 and -2 with Adafactor, which is
not elementwise, step whole parameters, each on its owner, and match too (a world of
2)."""

from __future__ import annotations

import functools

import pytest
import torch

from autopart.degrees import Axis
from autopart.ops.zero3 import sharded_parameters
from autopart.testing import run_world
from tests.harness import assert_every_rank_matches, case_key, train_case
from tests.models import LM_FACTORIES, token_batch, train_single_device

STEPS = 5
WORLD = 4
BATCH = token_batch(batch=8)
# The pure ZeRO-3 cases also report what each rank holds and which gathers it runs.
ZERO3 = {"dp": 4, "zero": 3}
DP4 = [(m, {"dp": 4, "zero": z}) for m in ("gpt2", "llama") for z in (1, 2, 3)]
# A pipeline's tied embedding stays whole under ZeRO-3 and is trained as under ZeRO-2,
# with one reduce-scatter per microbatch.
PIPELINE = {"dp": 2, "pp": 2, "zero": 3, "schedule": "1f1b", "microbatches": 2}
COMPOSED = [("gpt2", PIPELINE)]
# ZeRO-3 with recomputation (every block, one, or the attention cores alone) under tp
# and pp; alone, on 2 ranks, in tests/passes/test_recompute.py.
EVERY_LAYER = ("model.layers.0", "model.layers.1")
RECOMPUTED = [
    ("llama", {"dp": 2, "tp": 2, "zero": 3, "recompute": EVERY_LAYER}),
    ("llama-eager", {"dp": 2, "tp": 2, "zero": 3, "recompute": "attention"}),
    ("llama", {**PIPELINE, "recompute": EVERY_LAYER}),
    ("gpt2", {**PIPELINE, "recompute": ("transformer.h.1",)}),
]
CASES = DP4 + COMPOSED + RECOMPUTED


def _train(cases, batch) -> dict:
    return {
        case_key(model_name, pins): train_case(
            LM_FACTORIES[model_name](),
            batch,
            STEPS,
            inspect=_zero3_report if pins == ZERO3 else None,
            **pins,
        )
        for model_name, pins in cases
    }


def _zero3_report(pm) -> dict:
    """What this rank holds after a step, measured on the tensors themselves."""
    opt = pm.optimizer
    shards = [p for group in opt.param_groups for p in group["params"]]
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    grads = [p.grad for p in shards if p.grad is not None]
    zero3 = sharded_parameters(pm.graph)
    return {
        "held_bytes": sum(t.numel() * t.element_size() for t in shards + grads + state),
        "stage_parameters": [(name, p.numel()) for name, p in pm.graph.named_parameters()],
        "shard_numels": [p.numel() for p in zero3.shards],
        "bucket_bytes": max(layout.padded * 4 for layout in zero3.layouts),
        "gathered_after_step": zero3.gathered_bytes(),
        "peak_gathered": zero3.peak_gathered_bytes,
        "collectives": pm.collectives(),
        "graph": pm.graph.print_readable(print_output=False),
        "dp_group": pm.groups.group_name(Axis.DP),
    }


@functools.cache
def _world() -> list[dict]:
    return run_world(_train, WORLD, CASES, BATCH)


@functools.cache
def _reference(model_name: str) -> dict:
    return train_single_device(model_name, "adamw", STEPS, BATCH)


@pytest.mark.slow  # the world of 4
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_zero_matches_single_device(case):
    assert_every_rank_matches(_world(), case_key(*case), _reference(case[0]), label=case)


@pytest.mark.slow  # the world of 4
@pytest.mark.parametrize("model_name", ["gpt2", "llama"])
def test_zero3_holds_a_quarter_of_the_model_states(model_name):
    """Parameters + gradients + AdamW's two moments: 4 × the parameters' bytes in all;
    each rank holds a quarter, plus at most one bucket (padding, step counters)."""
    reference = _reference(model_name)["params"]
    full = 4 * sum(p.numel() * p.element_size() for p in reference.values())
    for results in _world():
        report = results[case_key(model_name, ZERO3)]
        assert full / WORLD <= report["held_bytes"] <= full / WORLD + report["bucket_bytes"]
        # The stage holds nothing else: its only parameters are the shards.
        assert [n for n, _ in report["stage_parameters"]] == [
            f"zero3.shards.{i}" for i in range(len(report["shard_numels"]))
        ]
        # Gathered buckets are released after the step; at most two are alive at once.
        assert report["gathered_after_step"] == 0
        assert 0 < report["peak_gathered"] <= 2 * report["bucket_bytes"]


@pytest.mark.slow  # the world of 4
@pytest.mark.parametrize("model_name", ["gpt2", "llama"])
def test_zero3_graph_lists_its_gathers(model_name):
    report = _world()[0][case_key(model_name, ZERO3)]
    gathers = [(name, info) for name, info in report["collectives"] if info.kind == "all_gather"]
    scatters = [info for _, info in report["collectives"] if info.kind.startswith("reduce_scatter")]
    # One gather per bucket; GPT-2's tied embedding is gathered again for the head.
    buckets = len(report["shard_numels"])
    assert len(gathers) == buckets + (model_name == "gpt2")
    assert len(scatters) == len(gathers)
    shard_bytes = {4 * n for n in report["shard_numels"]}
    for name, info in gathers:
        assert name in report["graph"]
        assert (info.axis, info.group) == ("dp", report["dp_group"])
        assert info.bytes in shard_bytes


WHOLE = [  # Adafactor: ZeRO by whole parameters (runtime/zero_owners.py)
    ("gpt2", {"dp": 2, "zero": 1}),
    ("llama", {"dp": 2, "zero": 1, "microbatches": 2}),
    ("gpt2", {"dp": 2, "zero": 2, "microbatches": 2}),
    ("llama", {"dp": 2, "zero": 2}),
]


def _train_whole(cases, batch) -> dict:
    return {
        case_key(model_name, pins): train_case(
            LM_FACTORIES[model_name](), batch, STEPS, "adafactor", inspect=_owned, **pins
        )
        for model_name, pins in cases
    }


def _owned(pm) -> dict:
    """How many elements this rank's optimizer steps, and whether they keep their shape."""
    stepped = [p for group in pm.optimizer.param_groups for p in group["params"]]
    shapes = {tuple(p.shape) for _, p in pm.graph.named_parameters()}
    return {
        "stepped": sum(p.numel() for p in stepped),
        "whole": all(tuple(p.shape) in shapes for p in stepped),
    }


@pytest.mark.slow  # a non-elementwise optimizer; ZeRO itself is checked quick
def test_zero_by_whole_parameters_matches_single_device_with_adafactor():
    per_rank = run_world(_train_whole, 2, WHOLE, BATCH)
    for model_name, pins in WHOLE:
        key = case_key(model_name, pins)
        reference = train_single_device(model_name, "adafactor", STEPS, BATCH)
        assert_every_rank_matches(per_rank, key, reference, label=(model_name, pins))
        total = sum(p.numel() for p in reference["params"].values())
        stepped = [results[key]["stepped"] for results in per_rank]
        assert sum(stepped) == total  # each parameter stepped by one rank, its owner
        assert all(0 < n < total for n in stepped)
        assert all(results[key]["whole"] for results in per_rank)
