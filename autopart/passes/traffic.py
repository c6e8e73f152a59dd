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
# Composite operators whose kernels write a tensor of an operand's size besides their
# output (operator -> the operand, by position): cross-entropy writes the log-softmax
# of its logits, then reads the targets' entries of it and reduces them to the loss.
WRITES_OPERAND = {"cross_entropy_loss": 0}
# Composite operators that read an operand more than once (operator -> (the operand,
# its reads)): cross-entropy's log-softmax reads its logits for each row's maximum,
# for the sum of their exponentials, and to write the log-probabilities.
READS_OPERAND = {"cross_entropy_loss": (0, 3)}


def traffic_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module") or (
            op_name(node, gm) in VIEW_OPS
        ):
            TRAFFIC.set(node, NONE)
            continue
        operands = tensor_operands(node, gm, ctx)
        read = sympy.Add(*(i.nbytes for i in operands))
        written = sympy.Add(*(o.nbytes for o in tensor_infos(node)))
        name = op_name(node, gm)
        kept = WRITES_OPERAND.get(name)
        if kept is not None and kept < len(operands):
            written += operands[kept].nbytes
        operand, reads = READS_OPERAND.get(name, (0, 1))
        if reads > 1 and operand < len(operands):
            read += (reads - 1) * operands[operand].nbytes
        TRAFFIC.set(node, Traffic(read, written))
    return gm
