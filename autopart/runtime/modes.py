"""Train and eval modes: the program each mode runs.

An exported graph is fixed in the mode its model was captured in (it refuses `train()`
and `eval()`): the first program runs dropout and batch normalization as the model ran
when `parallelize` captured it, training. Eval mode runs programs of its own: the model
captured again in eval mode (dropout off, batch normalization on its running
statistics) and rewritten under the same plan, holding the first program's tensors
(ops/program.py `sharing_tensors`). The parameters, buffers and ZeRO-3 shards that a
training step updates in place, and a pipeline's replicas of tied weights, are then the
very tensors eval mode reads: it always sees the current weights, and the optimizer,
gradient hooks and checkpoints, built over the first program, serve both modes.

Capturing the model again in its eval mode, rather than switching the captured dropout
and batch-norm operators off, runs what `model.eval()` runs whatever the model does with
its mode (`if self.training:` branches, attention dropout given as 0.0, layers skipped).

The first eval program is made at the example's inputs, when the module is first used
in eval mode: a capture and a rewrite, local to the rank, paid once. Inputs of other
sizes the capture kept static get programs of their own, as in training
(runtime/programs.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch.utils import _pytree as pytree

from autopart.ops.groups import MeshGroups
from autopart.ops.meta import TensorInfo
from autopart.ops.program import RankProgram
from autopart.runtime.executor import LocalExecutor
from autopart.runtime.programs import ProgramsByShape, ShapedProgram, quiet

if TYPE_CHECKING:
    from autopart.runtime.pipeline import PipelineExecutor

log = logging.getLogger("autopart.modes")


class MakeProgram(Protocol):
    """This rank's program of the plan made again, holding the first program's tensors,
    with its input shapes and dim ranges: for the global batch `inputs` (None: the
    example's), with the model as it trains, or in eval mode where `evaluating`."""

    def __call__(
        self, inputs: tuple | None = None, *, evaluating: bool = False
    ) -> tuple[RankProgram, Sequence[TensorInfo | None], Mapping[str, tuple[int, float]]]: ...


@dataclass(frozen=True, slots=True)
class EvalProgram:
    """A program of eval mode, and what runs its loss (None without a loss function)."""

    program: RankProgram
    executor: LocalExecutor | PipelineExecutor | None


class EvalPrograms:
    """The eval-mode programs of one plan, made on first use."""

    def __init__(
        self,
        make_program: MakeProgram,
        executor: LocalExecutor | PipelineExecutor | None,
        groups: MeshGroups,
    ) -> None:
        """`executor` runs the first program's loss: each eval program's is made like it
        (for a pipeline, with its tied weights' process groups and hooks)."""
        self.make_program = make_program
        self.executor = executor
        self.groups = groups
        self._programs: ProgramsByShape[EvalProgram] | None = None

    @property
    def first(self) -> EvalProgram:
        """The program of the example's inputs, made now where it is not yet. Local to
        the rank: `forward` may run on some ranks only."""
        return self._by_shape().programs[0].runner

    def serving(self, inputs: tuple, multiples: Mapping[str, int]) -> EvalProgram:
        """The program for the global batch `inputs` (`ProgramsByShape.serving`:
        collective where a new one is made)."""
        return self._by_shape().serving(inputs, multiples)

    def _by_shape(self) -> ProgramsByShape[EvalProgram]:
        if self._programs is None:
            self._programs = ProgramsByShape(self._made(None), self._made, self.groups)
            log.info("autopart: captured the model again in eval mode")
        return self._programs

    def _made(self, inputs: tuple | None) -> ShapedProgram[EvalProgram]:
        with quiet():
            program, shapes, ranges = self.make_program(
                filled(inputs, self.groups.device), evaluating=True
            )
        executor = self.executor.for_program(program) if self.executor is not None else None
        return ShapedProgram(EvalProgram(program, executor), tuple(shapes), dict(ranges))


def filled(inputs: tuple | None, device: torch.device) -> tuple | None:
    """`inputs` with stand-ins that hold no values (the per-rank convention's meta
    tensors for the global batch) made zeros: the capture reads shapes alone."""
    return pytree.tree_map_only(
        torch.Tensor,
        lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device) if t.is_meta else t,
        inputs,
    )
