"""A cross-entropy that ignores some tokens (padding, prompts) is the mean over the
others. Split over data-parallel ranks and microbatches, each part's own mean would
weigh its tokens by how many its part counts; the runtime weighs each part by its share
of the counted tokens instead, so training matches one device however the ignored
tokens fall, a wholly ignored microbatch included."""

from __future__ import annotations

import pytest
import torch

from autopart.ops.loss_match import CrossEntropy
from autopart.runtime.loss import microbatch_shares
from autopart.testing import run_world
from tests.harness import parallelize_lm, train_losses
from tests.models import tiny_llama, token_batch, train_reference

STEPS = 3


def _padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """8 sequences of 16 whose targets are ignored unevenly: the first two wholly,
    the next two mostly, the rest not at all."""
    ids, target = token_batch(8, 16)
    target = target.clone()
    target[:2] = -100
    target[2:4, 3:] = -100
    return ids, target


def _train(pins: dict) -> list[float]:
    pm = parallelize_lm(tiny_llama(), _padded_batch(), "sgd", **pins)
    losses = train_losses(pm, _padded_batch(), STEPS)
    pm.close()
    return losses


def _single_device() -> list[float]:
    ids, target = _padded_batch()
    return train_reference(tiny_llama(), "sgd", STEPS, (ids,), target)["losses"]


@pytest.mark.parametrize(
    "pins",
    [
        {"dp": 2, "microbatches": 2},
        pytest.param({"pp": 2, "microbatches": 4}, marks=pytest.mark.slow),
        pytest.param({"tp": 2, "microbatches": 4}, marks=pytest.mark.slow),
    ],
    ids=str,
)
def test_ignored_tokens_train_as_on_one_device(pins):
    reference = _single_device()
    for losses in run_world(_train, 2, pins):
        assert losses == pytest.approx(reference, rel=1e-5)


def test_each_part_weighs_its_share_of_the_counted_tokens():
    _, target = _padded_batch()
    ce = CrossEntropy(logits=0)
    # Counted tokens by quarter: 0, 6, 32, 32 of 70.
    assert microbatch_shares(ce, target, 2, 0, 2) == [0.0, 2 * 6 / 70]
    assert microbatch_shares(ce, target, 2, 1, 2) == [2 * 32 / 70, 2 * 32 / 70]
    # Nothing ignored, or another loss: every part alike.
    assert microbatch_shares(ce, token_batch(8, 16)[1], 2, 0, 2) == [0.5, 0.5]
    assert microbatch_shares(None, target, 2, 0, 2) == [0.5, 0.5]
