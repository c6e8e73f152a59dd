"""Operators that mix the examples of a batch are found (BatchNorm in training mode, a
batch × batch product); the ones that keep them apart are not. Found by the model zoo:
a BatchNorm CNN trained under dp=2 drifted from one device (each rank normalized by its
half's statistics), and CLIP's image × caption scores under dp=2 crashed in its loss.
The plans of such models keep the batch whole (tests/solver/test_search.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopart.capture import capture
from autopart.passes import analyze
from autopart.passes.batch_mixing import batch_mixing
from tests.models import MLP


def _mixing(model: nn.Module, *inputs: torch.Tensor) -> list[str]:
    captured = capture(model, inputs)
    analyze(captured.gm, captured.context())
    return batch_mixing(captured.gm)


class ConvNorm(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x)).mean(dim=(2, 3))


class PairScores(nn.Module):
    """Every example's embedding against every other's, as CLIP scores images and
    captions, and a per-example score beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = F.normalize(self.a(x), dim=-1), F.normalize(self.b(x), dim=-1)
        return (a * b).sum(-1), (a @ b.T) * 10.0


IMAGES = torch.randn(4, 3, 8, 8)


def test_batch_norm_in_training_mode_mixes_the_batch_and_is_named_by_module():
    (found,) = _mixing(ConvNorm(nn.BatchNorm2d(4)), IMAGES)
    assert found == "batch_norm in training mode normalizes over the batch, at norm"


@pytest.mark.parametrize(
    "norm",
    [nn.BatchNorm2d(4).eval(), nn.GroupNorm(2, 4), nn.InstanceNorm2d(4, affine=True)],
    ids=["batch_norm_eval", "group_norm", "instance_norm"],
)
def test_norms_over_each_example_keep_the_batch_apart(norm):
    # Instance norm runs as a batch norm of one example with batch × channels channels.
    assert _mixing(ConvNorm(norm), IMAGES) == []


def test_a_batch_by_batch_product_is_found_where_it_arises_only():
    (found,) = _mixing(PairScores(), torch.randn(4, 8))
    assert found.startswith("matmul gives a batch × batch result")


def test_a_model_that_keeps_the_examples_apart_mixes_nothing():
    assert _mixing(MLP(), torch.randn(4, 32)) == []
