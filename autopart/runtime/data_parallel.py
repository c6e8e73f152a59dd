"""Gradients and optimizer state across the data-parallel axis, by ZeRO stage.

A `DataParallelState` owns what happens to the gradients of this rank's parameters and
how the optimizer steps them:

    begin()   before the step's first backward
    finish()  after its last backward: gradients synchronized (waits)
    step()    the optimizer step, and whatever must follow it (ZeRO's parameter gather)
    close()   remove every hook autopart put on the model's parameters

Stage 0 (here) keeps a full replica of everything and all-reduces the gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import fx, nn

from autopart.runtime.grad_sync import GradientSync, params_in_backward_order

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class ReplicatedState:
    """ZeRO stage 0: plain data parallelism."""

    def __init__(
        self,
        stages: list[fx.GraphModule],
        group: dist.ProcessGroup,
        optimizer: OptimizerFactory,
        accumulation: int,
    ) -> None:
        self.sync = GradientSync(params_in_backward_order(stages), group, accumulation)
        self.optimizer = optimizer([p for gm in stages for p in gm.parameters()])

    def begin(self) -> None:
        self.sync.begin()

    def finish(self) -> None:
        self.sync.finish()

    def step(self) -> None:
        self.optimizer.step()

    def close(self) -> None:
        self.sync.close()


def build_data_parallel_state(
    zero: int,
    stages: list[fx.GraphModule],
    group: dist.ProcessGroup,
    optimizer: OptimizerFactory,
    accumulation: int,
) -> ReplicatedState:
    """The state for ZeRO stage `zero` of this rank's `stages` over the data-parallel
    `group`. `accumulation` is how many backward passes (microbatches) contribute to
    each step's gradients."""
    if zero == 0:
        return ReplicatedState(stages, group, optimizer, accumulation)
    raise NotImplementedError(f"ZeRO stage {zero} is not available yet")
