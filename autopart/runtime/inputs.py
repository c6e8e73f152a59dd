"""A step's inputs against the shapes the model was captured for.

Every rank gets the same global batch, so checking it before the step's first
collective makes every rank raise the same error together: an input of another shape
would otherwise fail differently on different ranks, deep inside the step (a pipeline
stage's receive buffers, export's guards), or leave the other ranks waiting.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import sympy
import torch
from torch.utils import _pytree as pytree

from autopart.batch import BATCH, BatchError
from autopart.ops.meta import TensorInfo


def check_inputs(
    inputs: Any,
    expected: Sequence[TensorInfo | None],
    ranges: Mapping[str, tuple[int, float]] | None = None,
    multiples: Mapping[str, int] | None = None,
    *,
    static_sizes: bool = True,
) -> None:
    """Raise BatchError unless each tensor of `inputs` (flattened) has the captured
    rank, dtype and fixed sizes, and the named dims ("batch", "seq", ...) one size
    each, within the sizes the capture allows (`ranges`, by dim name: a sequence no
    longer than a learned position table) and a multiple of what splits them
    (`multiples`: the sequence under context and sequence parallelism). The batch is checked for
    divisibility where it is split. With `static_sizes` False, a dim captured static
    may have another size: what a new capture at the step's shapes can mend."""
    leaves = pytree.tree_leaves(inputs)
    if len(leaves) > len(expected):
        raise BatchError(
            f"train_step got {len(leaves)} inputs, but the model was captured with "
            f"{len(expected)}: give the inputs of the example"
        )
    bound: dict[sympy.Expr, int] = {}
    for i, (leaf, info) in enumerate(zip(leaves, expected)):
        if info is None or not isinstance(leaf, torch.Tensor):
            continue
        problem = _mismatch(
            tuple(leaf.shape), leaf.dtype, info, bound, ranges or {}, multiples or {}, static_sizes
        )
        if problem:
            captured = "(" + ", ".join(str(d) for d in info.shape) + ")"
            raise BatchError(
                f"input {i} of train_step has shape {tuple(leaf.shape)} and dtype "
                f"{leaf.dtype}, but the model was captured for shape {captured} and dtype "
                f"{info.dtype}: {problem}. Give batches shaped as the example, or "
                "parallelize again with an example of this shape"
            )


def changed_static_dims(
    inputs: Any, expected: Sequence[TensorInfo | None]
) -> list[tuple[int, int]]:
    """(input, dim) of each dim the capture kept static whose size `inputs` change."""
    changed = []
    for i, (leaf, info) in enumerate(zip(pytree.tree_leaves(inputs), expected)):
        if info is None or not isinstance(leaf, torch.Tensor) or leaf.dim() != len(info.shape):
            continue
        for dim, (got, want) in enumerate(zip(leaf.shape, info.shape)):
            want = sympy.sympify(want)
            if want.is_Integer and int(want) != got:
                changed.append((i, dim))
    return changed


def _mismatch(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    info: TensorInfo,
    bound: dict[sympy.Expr, int],
    ranges: Mapping[str, tuple[int, float]],
    multiples: Mapping[str, int],
    static_sizes: bool,
) -> str | None:
    if len(shape) != len(info.shape):
        return f"{len(shape)} dims instead of {len(info.shape)}"
    if dtype != info.dtype:
        return "another dtype"
    for dim, (got, want) in enumerate(zip(shape, info.shape)):
        want = sympy.sympify(want)
        if want.is_Integer and int(want) != got and static_sizes:
            return f"dim {dim} is fixed at {want}"
        if want.is_Symbol and bound.setdefault(want, got) != got:
            return f"dim {dim} ({want}) is {bound[want]} in another input"
        low, high = ranges.get(str(want), (0, float("inf"))) if want.is_Symbol else (0, 0)
        if want.is_Symbol and str(want) != BATCH and not low <= got <= high:
            return f"dim {dim} ({want}) is {got}, outside the {low}..{high:g} the model allows"
        multiple = multiples.get(str(want), 1) if want.is_Symbol else 1
        if got % multiple:
            return (
                f"dim {dim} ({want}) is {got}, not a multiple of {multiple}, the parts "
                "that the plan splits it into (2 chunks per context-parallel rank, each "
                "split over the tensor-parallel ranks under sequence parallelism)"
            )
    return None
