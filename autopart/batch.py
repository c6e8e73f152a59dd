"""The batch dimension (dim 0 of every input): its size, and splitting it across ranks;
and the inputs' floating tensors in another dtype."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

# The names of the dynamic dims a capture gives the inputs: dim 0 of every input, and
# dim 1 of an integer input (token ids, masks). Costs, checks and rules read them by name.
BATCH = "batch"
SEQ = "seq"


def floating_in(inputs: Any, dtype: torch.dtype) -> Any:
    """`inputs` with their floating tensors in `dtype` (16-bit parameters' inputs, at
    capture and at every step); the others as they are."""
    return pytree.tree_map_only(
        torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, inputs
    )


class BatchError(ValueError):
    """A batch that cannot be split as the plan asks."""


def batch_size(inputs: Any) -> int:
    """The size of dim 0 shared by the tensors in `inputs`."""
    sizes = {t.shape[0] for t in pytree.tree_leaves(inputs) if _is_batched(t)}
    if not sizes:
        raise BatchError("the inputs hold no tensor with a batch dimension (dim 0)")
    if len(sizes) > 1:
        raise BatchError(f"the input tensors disagree on the batch size (dim 0): {sorted(sizes)}")
    return sizes.pop()


def check_divisible(batch: int, parts: int, what: str) -> None:
    if batch % parts:
        fits = [d for d in range(1, parts + 1) if batch % d == 0 and parts % d == 0]
        raise BatchError(
            f"the global batch of {batch} does not divide by {what}={parts}: use a batch that "
            f"is a multiple of {parts} (for example {parts * max(1, batch // parts)}), or "
            f"pin {what} to one of {fits}"
        )


def split_batch(inputs: Any, index: int, parts: int, what: str = "dp") -> Any:
    """Slice `index` of `parts` equal slices along dim 0 of every batched tensor."""
    batch = batch_size(inputs)
    check_divisible(batch, parts, what)
    size = batch // parts

    def take(x: Any) -> Any:
        return x.narrow(0, index * size, size) if _is_batched(x) else x

    return pytree.tree_map(take, inputs)


def _is_batched(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() > 0
