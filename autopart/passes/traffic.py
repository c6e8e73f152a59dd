"""Bytes each operator reads and writes: its tensor operands in, its outputs out.

Views move nothing. This is the traffic of an unfused kernel, which is what a roofline
needs; fusion by a compiler only lowers it.
"""

from __future__ import annotations

import sympy
from torch import fx

from autopart.ops.aten import VIEW_OPS, op_name
from autopart.ops.meta import TRAFFIC, Traffic, tensor_infos
from autopart.passes.flops import tensor_operands
from autopart.passes.runner import PassContext

NONE = Traffic(sympy.Integer(0), sympy.Integer(0))


def traffic_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module") or (
            op_name(node, gm) in VIEW_OPS
        ):
            TRAFFIC.set(node, NONE)
            continue
        read = sympy.Add(*(i.nbytes for i in tensor_operands(node, gm, ctx)))
        written = sympy.Add(*(o.nbytes for o in tensor_infos(node)))
        TRAFFIC.set(node, Traffic(read, written))
    return gm
