"""Running forward and backward over the microbatches of one step, without a pipeline."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from autopart.batch import split_batch
from autopart.ops.program import RankProgram
from autopart.runtime.compiled import runner
from autopart.runtime.loss import StepLoss
from autopart.runtime.precision import Precision


class LocalExecutor:
    """pp = 1: each microbatch runs forward then backward in turn; gradients accumulate.
    Each microbatch's loss is weighted by its share of the batch, so the accumulated
    gradient is that of the mean loss over the rank's whole batch."""

    def __init__(
        self,
        program: fx.GraphModule,
        loss_fn: StepLoss,
        microbatches: int,
        precision: Precision,
        compile: bool = False,
    ) -> None:
        """`compile`: run the program compiled by inductor (runtime/compiled.py)."""
        self.program = runner(program, compile)
        self.compile = compile
        self.loss_fn = loss_fn
        self.microbatches = microbatches
        self.precision = precision

    def run(self, args: tuple, target: Any, shares: list[float]) -> torch.Tensor:
        """Forward and backward over the rank's batch, each microbatch's loss weighted
        by its share (`StepLoss.shares`); returns the rank's loss (detached)."""
        losses = []
        for i in range(self.microbatches):
            loss = self._part(args, target, shares, i)
            self.precision.scale(loss).backward()
            losses.append(loss.detach().float())
        return torch.stack(losses).sum()

    def evaluate(self, args: tuple, target: Any, shares: list[float]) -> torch.Tensor:
        """The rank's loss as `run` returns it, forward only: no gradient."""
        with torch.no_grad():
            losses = [self._part(args, target, shares, i).float() for i in range(self.microbatches)]
        return torch.stack(losses).sum()

    def _part(self, args: tuple, target: Any, shares: list[float], i: int) -> torch.Tensor:
        """Microbatch `i`'s term of the rank's loss."""
        m = self.microbatches
        with self.precision.autocast():
            output = self.program(*split_batch(args, i, m, "microbatches"))
            part = split_batch(target, i, m, "microbatches")
            return self.loss_fn.part(output, part, shares[i])

    def for_program(self, program: RankProgram) -> LocalExecutor:
        """The same over another program of the plan (made for inputs of other shapes)."""
        loss_fn = self.loss_fn.for_program(program)
        return LocalExecutor(
            program.stages[0], loss_fn, self.microbatches, self.precision, self.compile
        )

    def close(self) -> None:
        """Nothing to release: no hooks of its own."""
