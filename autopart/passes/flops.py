"""Forward FLOPs of every operator, as sympy expressions of the named dims.

Exact for the contractions: a matmul producing N elements from a contraction of length
K costs 2·N·K (plus N for a fused bias); attention costs 2·B·L·S·(E + Ev) for its two
batched matmuls (the convention of the scaling-law papers: full, not causal, score
matrix); a convolution costs 2·N·(Cin/groups)·prod(kernel). Other arithmetic counts one
FLOP per element produced (per element read for reductions); views and pure data
movement count none.
"""

from __future__ import annotations

import sympy
import torch
from torch import fx
from torch.utils import _pytree as pytree

from autopart.ops.aten import (
    ATTENTION_OPS,
    DATA_MOVEMENT_OPS,
    GROUPED_MM_OPS,
    MATMUL_OPS,
    REDUCTION_OPS,
    VIEW_OPS,
    op_name,
)
from autopart.ops.meta import FLOPS, SHAPE, TensorInfo, tensor_infos
from autopart.passes.runner import PassContext

ZERO = sympy.Integer(0)


def flops_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    for node in gm.graph.nodes:
        FLOPS.set(node, node_flops(node, gm, ctx))
    return gm


def total_flops(gm: fx.GraphModule) -> sympy.Expr:
    return sympy.Add(*(FLOPS.get(n) for n in gm.graph.nodes))


def node_flops(node: fx.Node, gm: fx.GraphModule, ctx: PassContext) -> sympy.Expr:
    if node.op not in ("call_function", "call_method", "call_module"):
        return ZERO
    name = op_name(node, gm)
    if name in VIEW_OPS or name in DATA_MOVEMENT_OPS:
        return ZERO
    outs = tensor_infos(node)
    if not outs:
        return ZERO
    ins = tensor_operands(node, gm, ctx)
    out_numel = outs[0].numel
    if name in MATMUL_OPS and name != "einsum":
        return _contraction(name, ins, out_numel)
    if name in GROUPED_MM_OPS:  # each row [k] by one expert's [k, n]
        return 2 * out_numel * ins[0].shape[-1]
    if name in ATTENTION_OPS:
        q, k, v = ins[:3]
        length, e = q.shape[-2], q.shape[-1]
        batch = q.numel / (length * e)
        return 2 * batch * length * k.shape[-2] * (e + v.shape[-1])
    if name in ("convolution", "conv_transpose"):
        return _convolution(node, name, ins, out_numel)
    if name in REDUCTION_OPS and ins:
        return ins[0].numel
    return sympy.Add(*(o.numel for o in outs))


def _contraction(name: str, ins: list[TensorInfo], out_numel: sympy.Expr) -> sympy.Expr:
    if name in ("addmm", "baddbmm"):  # (bias, a, b)
        return 2 * out_numel * ins[1].shape[-1] + out_numel
    k = ins[0].shape[-1]
    bias = out_numel if name == "linear" and len(ins) > 2 else ZERO
    return 2 * out_numel * k + bias


def _convolution(
    node: fx.Node, name: str, ins: list[TensorInfo], out_numel: sympy.Expr
) -> sympy.Expr:
    x, w = ins[0], ins[1]
    kernel = sympy.Mul(*w.shape[2:])  # w.shape[1] is already Cin/groups (or Cout/groups)
    # aten.convolution carries `transposed` as its seventh argument.
    generic_transposed = (
        node.op == "call_function"
        and len(node.args) > 6
        and (
            getattr(node.target, "overloadpacket", None) is torch.ops.aten.convolution
            and bool(node.args[6])
        )
    )
    transposed = name == "conv_transpose" or generic_transposed
    bias = out_numel if len(ins) > 2 else ZERO
    if transposed:  # weight is (Cin, Cout/groups, *kernel): every input scatters
        return 2 * x.numel * w.shape[1] * kernel + bias
    return 2 * out_numel * w.shape[1] * kernel + bias


def tensor_operands(node: fx.Node, gm: fx.GraphModule, ctx: PassContext) -> list[TensorInfo]:
    """Tensor inputs in argument order; a leaf module's own weight and bias come last."""
    infos: list[TensorInfo] = []
    for arg in pytree.tree_leaves((node.args, node.kwargs)):
        if isinstance(arg, fx.Node) and isinstance(info := SHAPE.get(arg), TensorInfo):
            infos.append(info)
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        for p in module.parameters(recurse=False):
            infos.append(TensorInfo(tuple(ctx.expr(s) for s in p.shape), p.dtype))
    return infos
