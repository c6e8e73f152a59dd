"""Shapes that change between steps: the sequence dim is captured dynamic, so batches
of other lengths, and a smaller last batch, train as on one device, under data, tensor
and pipeline parallelism, with no new capture."""

from __future__ import annotations

import pytest

from autopart.testing import run_world
from tests.harness import parallelize_lm
from tests.models import lm_loss, make_optimizer, tiny_llama, token_batch

# (batch, sequence) of each step: the example's, shorter, longer, a smaller last batch
STEPS = [(8, 16), (8, 8), (8, 24), (4, 16)]


def _train_varying(pins: dict) -> dict:
    pm = parallelize_lm(tiny_llama(), token_batch(*STEPS[0]), **pins)
    captured = [dict(pm.dim_ranges)]
    losses = [pm.train_step(*token_batch(b, s)).item() for b, s in STEPS]
    pm.close()
    return {"losses": losses, "ranges": captured[0]}


def _single_device() -> list[float]:
    model = tiny_llama()
    optimizer = make_optimizer("adamw")(model.parameters())
    losses = []
    for b, s in STEPS:
        ids, target = token_batch(b, s)
        optimizer.zero_grad()
        loss = lm_loss(model(ids), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "pins", [{"dp": 2, "zero": 1}, {"tp": 2}, {"pp": 2, "microbatches": 2}], ids=str
)
def test_batches_of_other_lengths_train_as_on_one_device(pins):
    per_rank = run_world(_train_varying, 2, pins)
    reference = _single_device()
    for result in per_rank:
        assert result["ranges"]["seq"] == (2, 64)  # dynamic, up to the model's positions
        assert result["losses"] == pytest.approx(reference, rel=1e-5)
