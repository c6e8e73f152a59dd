"""Gradients and optimizer state across the data-parallel axis, by ZeRO stage.

A `DataParallelState` owns what happens to the gradients of this rank's parameters and
how the optimizer steps them:

    begin()   before the step's first backward
    finish()  after its last backward: gradients synchronized (waits)
    step()    the optimizer step, and whatever must follow it (ZeRO's parameter gather)
    close()   remove every hook autopart put on the model's parameters

Stage 0 (here) keeps a full replica of everything and all-reduces the gradients;
stages 1-3 shard optimizer state, gradients and parameters (runtime/zero.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import torch
import torch.distributed as dist
from torch import fx, nn

from autopart.runtime.grad_sync import GradientSync, params_in_backward_order
from autopart.runtime.zero import zero_state

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class DataParallelState(Protocol):
    optimizer: torch.optim.Optimizer

    def begin(self) -> None: ...

    def finish(self) -> None: ...

    def step(self) -> None: ...

    def close(self) -> None: ...


class LocalState:
    """A data-parallel axis of one rank: nothing to synchronize."""

    def __init__(self, stages: list[fx.GraphModule], optimizer: OptimizerFactory) -> None:
        self.optimizer = optimizer([p for gm in stages for p in gm.parameters()])

    def begin(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def finish(self) -> None:
        pass

    def step(self) -> None:
        self.optimizer.step()

    def close(self) -> None:
        pass


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
) -> DataParallelState:
    """The state for ZeRO stage `zero` of this rank's `stages` over the data-parallel
    `group`. `accumulation` is how many backward passes (microbatches) contribute to
    each step's gradients."""
    if dist.get_world_size(group) == 1:
        return LocalState(stages, optimizer)
    if zero == 0:
        return ReplicatedState(stages, group, optimizer, accumulation)
    return zero_state(zero, stages, group, optimizer, accumulation)
