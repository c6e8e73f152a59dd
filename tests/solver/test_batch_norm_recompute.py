"""A block whose batch norm runs in training mode updates its running statistics in
place; recomputed in backward, it would update them a second time. The solver never
recomputes such a block, and a pin that would is refused, saying why."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopart
from autopart.capture import capture
from autopart.cost_models import Choices, CostModels
from autopart.cost_models.stage_costs import stage_problem_of
from autopart.cost_models.summary import GraphSummary
from autopart.degrees import Degrees
from autopart.passes import analyze

TWO_CPUS = autopart.Mesh.cluster("cpu", nodes=1, per_node=2)


class Stack(nn.Module):
    """Four alike blocks, each a convolution, a norm and a ReLU."""

    def __init__(self, norm: type[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), norm(8), nn.ReLU()) for _ in range(4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.mean(dim=(1, 2, 3))


def _captured(norm: type[nn.Module]):
    captured = capture(Stack(norm), (torch.randn(4, 8, 8, 8),))
    analyze(captured.gm, captured.context())
    return captured


def _group_norm(channels: int) -> nn.Module:
    return nn.GroupNorm(2, channels)


@pytest.mark.parametrize(("norm", "recomputable"), [(nn.BatchNorm2d, 0), (_group_norm, 4)])
def test_the_solver_recomputes_no_block_that_updates_running_statistics(norm, recomputable):
    summary = GraphSummary(_captured(norm).gm)
    choices = Choices(4, Degrees(dp=2))
    problem = stage_problem_of(summary, choices, {}, CostModels.of(TWO_CPUS, "fp32"), 2**40, True)
    assert sum(u.kind is not None for u in problem.units) == recomputable


@pytest.mark.slow  # the solver's own choice, above, is the quick case
def test_a_pin_that_recomputes_a_batch_norm_block_is_refused():
    images = torch.randn(4, 8, 8, 8)
    for recompute in ("all", "layers.1", "layers"):
        with pytest.raises(autopart.PlanError, match="running statistics a second time"):
            autopart.plan(Stack(nn.BatchNorm2d), TWO_CPUS, (images,), recompute=recompute)
    assert autopart.plan(Stack(_group_norm), TWO_CPUS, (images,), recompute="all").recompute
