"""A model that scores its batch against itself (CLIP's image × caption matrix) under a
split of the batch (2 Gloo ranks) trains as one device does (passes/batch_products.py).
A loss that is a mean over the matrix's rows gets each replica's own rows: the replica
gathers the captions alone, their gradients flowing back to their owners, and scores its
own images against every caption. CLIP's symmetric loss reads the matrix's columns too,
and gets the whole: both sides gathered, the whole matrix on every replica."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import sympy
import torch

import autopart
from autopart.testing import run_world
from tests import zoo_media as media
from tests.models import assert_matches, make_optimizer, train_reference

STEPS = 3
LOSSES = {"symmetric": media.contrastive_loss, "rows": media.image_loss}
KEPT = {"symmetric": "whole", "rows": "rows"}  # what the loss gets of the product
MODELS = {"two_tower": media.TwoTower, "clip": media.clip}
# Each replica's part of the batch, and the bytes it holds of one side's embeddings
# (the two-tower model's are 8 wide, float32).
LOCAL = media.BATCH // 2
EMBEDDING = LOCAL * 8 * 4


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return MODELS[name]()


def _trained(model: str, loss: str, optimizer: str, pins: dict[str, Any]) -> dict[str, Any]:
    inputs, target = media.image_text_batch()
    pm = autopart.parallelize(
        _model(model),
        autopart.Mesh.local(),
        inputs,
        loss_fn=LOSSES[loss],
        optimizer=make_optimizer(optimizer),
        **pins,
    )
    losses = [pm.train_step(inputs, target).item() for _ in range(STEPS)]
    result = {
        "losses": losses,
        "params": pm.full_state_dict(),
        "plan": pm.plan,
        # What a replica gathers of the batch, and the score matrix it computes.
        "gathered": [
            int(
                sympy.sympify(info.bytes).subs(
                    {s: LOCAL for s in sympy.sympify(info.bytes).free_symbols}
                )
            )
            for _, info in pm.collectives()
            if info.kind == "all_gather"
        ],
        "scores": tuple(pm(*pm.local_batch(inputs)).shape),
    }
    pm.close()
    return result


def _trained_both(model: str, optimizer: str, pins: dict[str, Any]) -> dict[str, Any]:
    return {loss: _trained(model, loss, optimizer, pins) for loss in LOSSES}


@functools.cache
def _one_device(model: str, loss: str, optimizer: str) -> dict[str, Any]:
    inputs, target = media.image_text_batch()
    return train_reference(_model(model), optimizer, STEPS, inputs, target, LOSSES[loss])


def _differences(got: dict[str, Any], want: dict[str, Any]) -> tuple[float, float]:
    """The largest relative loss difference and the parameters' relative difference."""
    loss = max(abs(g - w) / abs(w) for g, w in zip(got["losses"], want["losses"], strict=True))
    err = sum((got["params"][k] - v).norm() ** 2 for k, v in want["params"].items()) ** 0.5
    norm = sum(v.norm() ** 2 for v in want["params"].values()) ** 0.5
    return loss, float(err / norm)


@functools.cache
def _quick_world() -> list[dict[str, Any]]:
    """The two-tower model at dp=2 under each loss, in one world."""
    return run_world(_trained_both, 2, "two_tower", "adamw", {"dp": 2})


@pytest.mark.parametrize("loss", ["symmetric", "rows"], ids=["whole", "rows"])
def test_a_two_tower_model_trains_like_one_device_at_dp2(loss):
    """CLIP's symmetric loss gets the whole product; the image side alone, its rows."""
    want = _one_device("two_tower", loss, "adamw")
    for result in (per_rank[loss] for per_rank in _quick_world()):
        assert result["plan"].dp == 2 and result["plan"].batch_product_loss == KEPT[loss]
        print(f"{loss}: loss, params relative to one device: {_differences(result, want)}")
        assert_matches(result, want, rtol=1e-5)


def test_a_loss_over_the_rows_scores_each_replica_s_rows_against_every_column():
    """Under the rows' loss a replica gathers the captions' embeddings alone and its
    score matrix is its own images' rows by every caption; under the whole, both sides
    are gathered and the matrix is the whole batch's."""
    for per_rank in _quick_world():
        rows, whole = per_rank["rows"], per_rank["symmetric"]
        assert rows["gathered"] == [EMBEDDING]
        assert rows["scores"] == (LOCAL, media.BATCH)
        assert sorted(whole["gathered"]) == [EMBEDDING, EMBEDDING]
        assert whole["scores"] == (media.BATCH, media.BATCH)
        assert "scores its own rows against every column" in rows["plan"].explain()
        assert "computes the whole product" in whole["plan"].explain()


CLIP_CASES = {
    "dp2": ({"dp": 2}, "symmetric"),
    "zero3": ({"dp": 2, "zero": 3}, "symmetric"),
    # Hugging Face's CLIP scores captions against images and returns the transpose:
    # the rows a replica keeps are its images', the product's second operand.
    "dp2-rows": ({"dp": 2}, "rows"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CLIP_CASES)
def test_clip_trains_like_one_device_under_a_split_of_the_batch(case):
    pins, loss = CLIP_CASES[case]
    want = _one_device("clip", loss, "adamw")
    for result in run_world(_trained, 2, "clip", loss, "adamw", pins):
        assert result["plan"].batch_product_loss == KEPT[loss]
        if loss == "rows":
            assert result["scores"] == (LOCAL, media.BATCH)
        print(f"{case}: loss, params relative to one device: {_differences(result, want)}")
        # The zoo's bound: a key bias's gradient is zero but for rounding, which AdamW
        # turns into steps of the learning rate's size (4e-4 of that tensor here).
        assert_matches(result, want, rtol=1e-4)
