"""examples/finetune.py, the README's training loop, runs on 2 Gloo ranks and agrees
with the same loop on one device."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from autopart.testing import run_world

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
import finetune  # noqa: E402  (examples/ is not a package)


@pytest.mark.slow  # a whole example run; the README's main job runs in test_docs
def test_the_finetune_loop_agrees_with_one_device():
    """Per-rank DataLoader shares, AdamW with a warm-up cosine schedule, clipping at
    1.0, gradient accumulation, eval-mode validation and a checkpoint resumed under
    another plan: without dropout, every loss, validation loss, learning rate and
    gradient norm is one device's."""
    args = finetune.parse(["--dropout", "0", "--steps", "6", "--validate-every", "3"])
    assert run_world(finetune.job, 2, args) == [True, True]
