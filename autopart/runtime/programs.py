"""The programs of one plan, by the input shapes they serve.

A model may need a dim of its inputs fixed (a length turned into a Python int, a
reshape to a literal size): torch.export then keeps that dim static, and the captured
program takes that size only. A step whose inputs differ from every program's only in
such sizes (same inputs, ranks and dtypes) gets a program of its own: the model
captured again at the step's shapes and rewritten under the same plan, holding the
first program's tensors (ops/program.py `sharing_tensors`), so the parameters, the
optimizer state and the gradient hooks serve every program. Each new program is logged
once; a later step of shapes seen before runs the program that served them.

Every rank gets the same global batch, so every rank picks the same program, and
decides to capture again, before the step's first collective. Making the program is
local work, but a rank could fail at it where others do not: one all-reduce after it
makes every rank raise together rather than leave the others waiting in the step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from autopart.batch import BatchError
from autopart.degrees import MESH_AXES
from autopart.ops.groups import MeshGroups
from autopart.ops.meta import TensorInfo
from autopart.runtime.inputs import changed_static_dims, check_inputs

log = logging.getLogger("autopart.shapes")

Runner = TypeVar("Runner")


@dataclass(frozen=True, slots=True)
class ShapedProgram(Generic[Runner]):
    """What runs a program, and the inputs it takes: the model's (flattened) inputs as
    captured, and the sizes each named dim may take."""

    runner: Runner
    input_shapes: tuple[TensorInfo | None, ...]
    dim_ranges: Mapping[str, tuple[int, float]] = field(default_factory=dict)


# Given a step's inputs (the global batch), the program made again for their shapes.
MakeAgain = Callable[[tuple], ShapedProgram[Runner]]


class ProgramsByShape(Generic[Runner]):
    """The first program, and those made again for inputs of other static sizes."""

    def __init__(
        self,
        first: ShapedProgram[Runner],
        make_again: MakeAgain | None,
        groups: MeshGroups,
    ) -> None:
        """`make_again` is None where the model cannot be captured again (a program
        that came from elsewhere); every rank of `groups` agrees on each new one."""
        self.programs = [first]
        self.make_again = make_again
        self.groups = groups
        self._served: dict[tuple, ShapedProgram[Runner]] = {}

    def serving(self, inputs: tuple, multiples: Mapping[str, int]) -> Runner:
        """The runner of the program for `inputs`: one that takes them, else one made
        for them. Raises BatchError, on every rank alike, for inputs no program takes
        and a new capture cannot serve (another rank or dtype, a sequence longer than
        the model's positions, a sequence parallelism cannot split)."""
        key = _shapes(inputs)
        if key not in self._served:
            self._served[key] = self._find(inputs, multiples) or self._make(inputs, multiples)
        return self._served[key].runner

    def _find(self, inputs: tuple, multiples: Mapping[str, int]) -> ShapedProgram | None:
        for program in self.programs:
            try:
                check_inputs(inputs, program.input_shapes, program.dim_ranges, multiples)
            except BatchError:
                continue
            return program
        return None

    def _make(self, inputs: tuple, multiples: Mapping[str, int]) -> ShapedProgram[Runner]:
        first = self.programs[0]
        changed = changed_static_dims(inputs, first.input_shapes)
        mendable = self.make_again is not None and bool(changed)
        # Raises the first program's error unless a capture at these shapes mends it:
        # only sizes the exporter kept static differ.
        check_inputs(
            inputs, first.input_shapes, first.dim_ranges, multiples, static_sizes=not mendable
        )
        assert self.make_again is not None, "the first program refused what it takes"
        shapes = ", ".join(str(s) for s, _ in _shapes(inputs))
        try:
            with quiet():
                program = self.make_again(inputs)
            check_inputs(inputs, program.input_shapes, program.dim_ranges, multiples)
        except Exception as e:  # noqa: BLE001 - every rank must learn of it, then raise
            self._agree(e, shapes)
            raise  # _agree raised already; this keeps the type checker's flow
        self._agree(None, shapes)
        log.info("autopart: captured again for input shapes %s: %s", shapes, _why(changed, first))
        self.programs.append(program)
        return program

    def _agree(self, error: Exception | None, shapes: str) -> None:
        """Raise on every rank if any rank could not make the program."""
        failed = [error is not None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            flags = torch.zeros(dist.get_world_size(), device=self.groups.device)
            flags[dist.get_rank()] = float(error is not None)
            dist.all_reduce(flags, group=self.groups.group(*MESH_AXES))
            failed = [bool(f) for f in flags.tolist()]
        if not any(failed):
            return
        ranks = [r for r, f in enumerate(failed) if f]
        reason = f": {error}" if error is not None else ", whose error says why"
        raise BatchError(
            f"train_step got input shapes {shapes}, which the program does not take, and "
            f"capturing the model again at them failed on rank(s) {ranks}{reason}"
        ) from error


@contextmanager
def quiet() -> Iterator[None]:
    """autopart's loggers held at WARNING: a program made again repeats the first one's
    capture and rewrite, whose INFO lines (tensor-parallel fallbacks, ...) would repeat
    the first program's; one line says what happened instead."""
    logger = logging.getLogger("autopart")
    level = logger.level
    logger.setLevel(max(logging.WARNING, logger.getEffectiveLevel()))
    try:
        yield
    finally:
        logger.setLevel(level)


def _shapes(inputs: Any) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    return tuple(
        (tuple(x.shape), x.dtype) for x in pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor)
    )


def _why(changed: list[tuple[int, int]], first: ShapedProgram) -> str:
    """'dim 1 was captured static'; with several inputs, each dim names its input."""
    several = len(first.input_shapes) > 1
    dims = [f"dim {d} of input {i}" if several else f"dim {d}" for i, d in changed]
    listed = dims[0] if len(dims) == 1 else ", ".join(dims[:-1]) + " and " + dims[-1]
    return f"{listed} {'was' if len(dims) == 1 else 'were'} captured static"
