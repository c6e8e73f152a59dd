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


class BothWays(media.TwoTower):
    """The scores and their transpose, both returned: no one side gives both outputs'
    rows."""

    def forward(self, ids: torch.Tensor, pixels: torch.Tensor) -> tuple:
        scores = super().forward(ids, pixels)
        return scores, scores.T


def _first_rows(output: tuple, target: torch.Tensor) -> torch.Tensor:
    return media.image_loss(output[0], target)


LOSSES = {"symmetric": media.contrastive_loss, "rows": media.image_loss, "first": _first_rows}
KEPT = {"symmetric": "whole", "rows": "rows", "first": "rows"}  # what the loss gets
MODELS = {"two_tower": media.TwoTower, "clip": media.clip, "both_ways": BothWays}
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
        "gathered": [_local(i.bytes) for _, i in pm.collectives() if i.kind == "all_gather"],
        "scores": tuple(_first(pm(*pm.local_batch(inputs))).shape),
    }
    pm.close()
    return result


def _first(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def _local(nbytes: object) -> int:
    """A collective's bytes per rank, at this replica's part of the batch."""
    size = sympy.sympify(nbytes)
    return int(size.subs({s: LOCAL for s in size.free_symbols}))


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


# What a replica gathers and the score matrix it computes, under each loss: the
# captions' embeddings alone and its own images' rows by every caption, or both sides
# and the whole batch's matrix.
GATHERED = {"rows": [EMBEDDING], "symmetric": [EMBEDDING, EMBEDDING]}
SCORES = {"rows": (LOCAL, media.BATCH), "symmetric": (media.BATCH, media.BATCH)}
SAYS = {"rows": "scores its own rows against every column", "symmetric": "the whole product"}


@pytest.mark.parametrize(
    "loss", ["rows", pytest.param("symmetric", marks=pytest.mark.slow)], ids=["rows", "whole"]
)
def test_a_two_tower_model_trains_like_one_device_at_dp2(loss):
    """The image side of CLIP's loss alone, a mean over the rows, gets each replica's
    rows, which it scores against every caption; CLIP's symmetric loss, the whole."""
    want = _one_device("two_tower", loss, "adamw")
    for result in run_world(_trained, 2, "two_tower", loss, "adamw", {"dp": 2}):
        assert result["plan"].dp == 2 and result["plan"].batch_product_loss == KEPT[loss]
        assert sorted(result["gathered"]) == GATHERED[loss]
        assert result["scores"] == SCORES[loss]
        assert SAYS[loss] in result["plan"].explain()
        print(f"{loss}: loss, params relative to one device: {_differences(result, want)}")
        assert_matches(result, want, rtol=1e-5)


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
        assert result["scores"] == SCORES[loss]
        print(f"{case}: loss, params relative to one device: {_differences(result, want)}")
        # The zoo's bound: a key bias's gradient is zero but for rounding, which AdamW
        # turns into steps of the learning rate's size (4e-4 of that tensor here).
        assert_matches(result, want, rtol=1e-4)


@pytest.mark.slow
def test_a_loss_over_the_rows_of_outputs_no_one_side_leads_keeps_its_rows_of_the_whole():
    """Where the outputs' rows come from both sides (the scores and their transpose),
    both sides are gathered and each replica keeps its own rows of each output."""
    want = _one_device("both_ways", "first", "adamw")
    for result in run_world(_trained, 2, "both_ways", "first", "adamw", {"dp": 2}):
        assert result["plan"].batch_product_loss == "rows"
        assert sorted(result["gathered"]) == [EMBEDDING, EMBEDDING]
        assert result["scores"] == (LOCAL, media.BATCH)
        assert_matches(result, want, rtol=1e-5)
