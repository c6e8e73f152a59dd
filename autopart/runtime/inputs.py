"""A step's inputs against the shapes the model was captured for.

Every rank gets the same global batch, so checking it before the step's first
collective makes every rank raise the same error together: an input of another shape
would otherwise fail differently on different ranks, deep inside the step (a pipeline
stage's receive buffers, export's guards), or leave the other ranks waiting.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sympy
import torch
from torch.utils import _pytree as pytree

from autopart.batch import BatchError
from autopart.ops.meta import TensorInfo


def check_inputs(inputs: Any, expected: Sequence[TensorInfo | None]) -> None:
    """Raise BatchError unless each tensor of `inputs` (flattened) has the captured
    rank, dtype and fixed sizes, and the named dims ("batch", ...) one size each."""
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
        problem = _mismatch(tuple(leaf.shape), leaf.dtype, info, bound)
        if problem:
            captured = "(" + ", ".join(str(d) for d in info.shape) + ")"
            raise BatchError(
                f"input {i} of train_step has shape {tuple(leaf.shape)} and dtype "
                f"{leaf.dtype}, but the model was captured for shape {captured} and dtype "
                f"{info.dtype}: {problem}. Give batches shaped as the example, or "
                "parallelize again with an example of this shape"
            )


def _mismatch(
    shape: tuple[int, ...], dtype: torch.dtype, info: TensorInfo, bound: dict[sympy.Expr, int]
) -> str | None:
    if len(shape) != len(info.shape):
        return f"{len(shape)} dims instead of {len(info.shape)}"
    if dtype != info.dtype:
        return "another dtype"
    for dim, (got, want) in enumerate(zip(shape, info.shape)):
        want = sympy.sympify(want)
        if want.is_Integer and int(want) != got:
            return f"dim {dim} is fixed at {want}"
        if want.is_Symbol and bound.setdefault(want, got) != got:
            return f"dim {dim} ({want}) is {bound[want]} in another input"
    return None
