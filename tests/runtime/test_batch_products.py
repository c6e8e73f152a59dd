"""A model that scores its batch against itself (CLIP's image × caption matrix) under a
split of the batch (2 Gloo ranks): each replica gathers both sides' embeddings, their
gradients flowing back to their owners, and the loss is one device's
(passes/batch_products.py). CLIP's symmetric loss reads the matrix's columns too, and
gets the whole; a loss that is a mean over its rows gets each replica's rows."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import autopart
from autopart.testing import run_world
from tests import zoo_media as media
from tests.models import assert_matches, make_optimizer, train_reference

STEPS = 3
LOSSES = {"symmetric": media.contrastive_loss, "rows": media.image_loss}
KEPT = {"symmetric": "whole", "rows": "rows"}  # what the loss gets of the product
MODELS = {"two_tower": media.TwoTower, "clip": media.clip}


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
    result = {"losses": losses, "params": pm.full_state_dict(), "plan": pm.plan}
    pm.close()
    return result


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


@pytest.mark.parametrize(
    "loss", ["symmetric", pytest.param("rows", marks=pytest.mark.slow)], ids=["whole", "rows"]
)
def test_a_two_tower_model_trains_like_one_device_at_dp2(loss):
    """CLIP's symmetric loss gets the whole product; the image side alone, its rows."""
    want = _one_device("two_tower", loss, "adamw")
    for result in run_world(_trained, 2, "two_tower", loss, "adamw", {"dp": 2}):
        assert result["plan"].dp == 2 and result["plan"].batch_product_loss == KEPT[loss]
        print(f"{loss}: loss, params relative to one device: {_differences(result, want)}")
        assert_matches(result, want, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("pins", [{"dp": 2}, {"dp": 2, "zero": 3}], ids=["dp2", "zero3"])
def test_clip_trains_like_one_device_under_a_split_of_the_batch(pins):
    want = _one_device("clip", "symmetric", "adamw")
    for result in run_world(_trained, 2, "clip", "symmetric", "adamw", pins):
        assert result["plan"].batch_product_loss == "whole"
        print(f"{pins}: loss, params relative to one device: {_differences(result, want)}")
        # The zoo's bound: a key bias's gradient is zero but for rounding, which AdamW
        # turns into steps of the learning rate's size (4e-4 of that tensor here).
        assert_matches(result, want, rtol=1e-4)
