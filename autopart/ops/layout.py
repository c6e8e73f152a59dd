"""Memory layouts a rewrite must keep: a value's dim order as the captured graph saw it.

torch.export traces against the strides each operator's value had at capture, and
bakes them in: a `.contiguous()` that was a no-op is dropped, and a `reshape` the
strides allowed as a view is captured as `view`. A fused attention kernel, for one,
returns [batch, heads, seq, head_dim] laid out as [batch, seq, heads, head_dim], so that
`y.transpose(1, 2).contiguous().view(b, s, h·d)` is captured as a transpose and a view
alone. An operator a rewrite puts in a node's place must then return its value in the
node's captured dim order, or such a view fails ("view size is not compatible with input
tensor's size and stride").

A dim order lists the dims from the outermost (largest stride) to the innermost, as
`torch.Tensor.dim_order` gives it: (0, 1, 2, 3) is contiguous, (0, 2, 1, 3) is the fused
kernel's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import fx

DimOrder = tuple[int, ...]


def captured_dim_order(node: fx.Node) -> DimOrder | None:
    """The dim order of the one tensor `node` produced at capture, or None where the
    capture recorded none (fx.symbolic_trace keeps `.contiguous()` and `reshape` as the
    model wrote them, so no layout is baked in) or the node produced no single tensor."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return None
    return tuple(value.dim_order())


def _inverse(order: Sequence[int]) -> list[int]:
    return sorted(range(len(order)), key=order.__getitem__)


def empty_in_order(
    shape: Sequence[int], order: DimOrder | None, like: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """An uninitialized tensor of `shape` on `like`'s device, laid out in `order`
    (contiguous where None)."""
    if order is None:
        return like.new_empty(tuple(shape), dtype=dtype)
    outer_first = like.new_empty(tuple(shape[d] for d in order), dtype=dtype)
    return outer_first.permute(_inverse(order))


def in_dim_order(x: torch.Tensor, order: DimOrder | None) -> torch.Tensor:
    """`x`, copied into `order` where it is laid out otherwise (differentiable)."""
    if order is None or tuple(x.dim_order()) == order:
        return x
    return x.permute(order).contiguous().permute(_inverse(order))
