"""Master weights on the host: the device's trained parameters are 16-bit copies.

With `master_weights="host"` the runtime keeps each trained parameter's fp32 value on
the host and a 16-bit copy on the device (runtime/offload.py `lower`). The graph was
captured over fp32 parameters and runs under the plan's autocast, which converts a
contraction's operands (a linear layer's weight) to 16 bits anyway: such a reader reads
the copy as it is, and computes exactly what it would have. Every other reader (a
norm's gain, an embedding table, a bias added outside a contraction) reads the copy
widened back to the captured dtype, just before it, so that the activations keep their
captured dtypes (pipeline transfers, collectives and the loss expect them) and the
operator computes in fp32 over the 16-bit-rounded weight. That rounding, and gradients
accumulated and reduced in 16 bits, is all that changes from the fp32-master run.
"""

from __future__ import annotations

import torch
from torch import fx

from autopart.ops.meta import SHAPE, inherit
from autopart.ops.params import parameter_attributes
from autopart.passes.runner import PassContext

aten = torch.ops.aten

# Operators autocast runs in 16 bits, converting every floating operand, on CPUs and
# GPUs both (in both of PyTorch's lower-precision lists). Any other reader is widened:
# exact whatever it is, only a cast slower.
AUTOCAST_CONTRACTIONS = frozenset(
    {
        aten.linear.default,
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten.matmul.default,
        aten.conv1d.default,
        aten.conv2d.default,
        aten.conv3d.default,
    }
)


def widen_weight_reads_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Every reader of a trained parameter but an autocast contraction reads it widened
    to its captured dtype, through a cast inserted just before the reader (so the wide
    copy lives no longer than the reader needs it)."""
    for node, param in parameter_attributes(gm):
        if not (param.requires_grad and param.is_floating_point()):
            continue
        for reader in list(node.users):
            if reader.op == "call_function" and reader.target in AUTOCAST_CONTRACTIONS:
                continue
            with gm.graph.inserting_before(reader):
                wide = gm.graph.call_function(aten.to.dtype, (node, param.dtype))
            inherit(wide, reader, SHAPE.get(node, None))
            reader.replace_input_with(node, wide)
    gm.graph.lint()
    gm.recompile()
    return gm
