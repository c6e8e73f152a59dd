"""Shapes that change between steps, under data, tensor and pipeline parallelism: the
sequence dim is captured dynamic, so batches of other lengths, and a smaller last batch,
train as on one device with no new capture; a model whose length the exporter keeps
static is captured again once per new length, and trains as on one device too."""

from __future__ import annotations

import logging

import pytest
import sympy
import torch

from autopart.batch import BATCH, BatchError
from autopart.ops.meta import TensorInfo
from autopart.runtime.programs import ProgramsByShape, ShapedProgram
from autopart.testing import run_world
from tests.harness import parallelize_lm
from tests.models import FixedLengthLM, lm_loss, make_optimizer, tiny_llama, token_batch

# (batch, sequence) of each step: the example's, shorter, longer, a smaller last batch
STEPS = [(8, 16), (8, 8), (8, 24), (4, 16)]


def _train_varying(pins: dict) -> dict:
    pm = parallelize_lm(tiny_llama(), token_batch(*STEPS[0]), **pins)
    captured = [dict(pm.dim_ranges)]
    losses = [pm.train_step(*token_batch(b, s)).item() for b, s in STEPS]
    pm.close()
    return {"losses": losses, "ranges": captured[0]}


def _single_device(model=None, steps=STEPS) -> list[float]:
    model = model or tiny_llama()
    optimizer = make_optimizer("adamw")(model.parameters())
    losses = []
    for b, s in steps:
        ids, target = token_batch(b, s)
        optimizer.zero_grad()
        loss = lm_loss(model(ids), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "pins",
    [
        pytest.param({"dp": 2, "zero": 1}, marks=pytest.mark.slow),
        {"tp": 2},
        {"pp": 2, "microbatches": 2},
    ],
    ids=str,
)
def test_batches_of_other_lengths_train_as_on_one_device(pins):
    per_rank = run_world(_train_varying, 2, pins)
    reference = _single_device()
    for result in per_rank:
        assert result["ranges"]["seq"] == (2, 64)  # dynamic, up to the model's positions
        assert result["losses"] == pytest.approx(reference, rel=1e-5)


# A model that fixes its length: two new lengths, one of them again, then smaller
# batches of lengths seen (the batch stays dynamic in every program).
FIXED_STEPS = [(8, 16), (8, 24), (8, 8), (8, 24), (4, 16), (4, 8)]


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _train_fixed_length(pins: dict) -> dict:
    pm = parallelize_lm(FixedLengthLM(), token_batch(*FIXED_STEPS[0]), **pins)
    logger, handler = logging.getLogger("autopart"), _Messages()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    losses = [pm.train_step(*token_batch(b, s)).item() for b, s in FIXED_STEPS]
    logger.removeHandler(handler)
    try:  # longer than the position table: no capture can serve it
        pm.train_step(*token_batch(8, 80))
        refused = ""
    except BatchError as e:
        refused = str(e)
    result = {
        "losses": losses,
        "messages": handler.messages,
        "programs": len(pm.programs.programs),
        "refused": refused,
        "ranges": dict(pm.dim_ranges),
    }
    pm.close()
    return result


@pytest.mark.parametrize(
    "pins",
    [{"dp": 2}, pytest.param({"tp": 2}, marks=pytest.mark.slow), {"pp": 2, "microbatches": 2}],
    ids=str,
)
def test_a_length_the_exporter_keeps_static_is_captured_again_per_new_length(pins):
    per_rank = run_world(_train_fixed_length, 2, pins)
    reference = _single_device(FixedLengthLM(), FIXED_STEPS)
    assert per_rank[0]["refused"] == per_rank[1]["refused"]  # every rank, the same error
    for result in per_rank:
        assert "seq" not in result["ranges"]  # the exporter kept it static
        assert result["losses"] == pytest.approx(reference, rel=1e-5)
        captured = [m for m in result["messages"] if "captured again" in m]
        assert captured == [
            "autopart: captured again for input shapes (8, 24): dim 1 was captured static",
            "autopart: captured again for input shapes (8, 8): dim 1 was captured static",
        ]
        # The pipeline makes its stages again for each new microbatch shape, and says so.
        others = [m for m in result["messages"] if m not in captured]
        assert all(m.startswith("pipeline stages for a new microbatch shape") for m in others)
        assert result["programs"] == 3  # (8, 24) again took its program, not a new one
        assert "(8, 80)" in result["refused"] and "failed on rank(s) [0, 1]" in result["refused"]


def test_only_sizes_captured_static_are_captured_again():
    """A new capture is made once per shape that differs only in sizes captured static,
    and kept; another dtype or rank is the program's own error, with no capture."""
    batch = sympy.Symbol(BATCH, positive=True, integer=True)

    def program(seq: int) -> ShapedProgram:
        return ShapedProgram(f"seq {seq}", (TensorInfo((batch, sympy.Integer(seq)), torch.int64),))

    made: list[tuple] = []

    def make_again(inputs: tuple) -> ShapedProgram:
        made.append(tuple(inputs[0].shape))
        return program(inputs[0].shape[1])

    programs = ProgramsByShape(program(16), make_again, groups=None)  # type: ignore[arg-type]
    shapes = [(8, 16), (8, 24), (4, 24), (8, 24)]
    served = [programs.serving((torch.zeros(shape, dtype=torch.int64),), {}) for shape in shapes]
    assert served == ["seq 16", "seq 24", "seq 24", "seq 24"]
    assert made == [(8, 24)]
    with pytest.raises(BatchError, match="another dtype"):
        programs.serving((torch.zeros(8, 32, dtype=torch.int32),), {})
    with pytest.raises(BatchError, match="3 dims instead of 2"):
        programs.serving((torch.zeros(8, 32, 2, dtype=torch.int64),), {})
    assert made == [(8, 24)]
