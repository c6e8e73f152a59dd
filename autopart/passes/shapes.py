"""Shape and dtype of every node, as sympy expressions of the named dynamic dims."""

from __future__ import annotations

import torch
from torch import fx

from autopart.ops.meta import SHAPE, TensorInfo
from autopart.passes.runner import PassContext


def shape_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    for node in gm.graph.nodes:
        SHAPE.set(node, _info(node.meta.get("val"), ctx))
    return gm


def _info(val: object, ctx: PassContext) -> TensorInfo | tuple | None:
    if isinstance(val, torch.Tensor):
        return TensorInfo(tuple(ctx.expr(s) for s in val.shape), val.dtype)
    if isinstance(val, (tuple, list)):
        return tuple(_info(v, ctx) if isinstance(v, torch.Tensor) else None for v in val)
    return None
