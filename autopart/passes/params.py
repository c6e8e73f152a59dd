"""Which parameters each operator reads (by canonical FQN; tied weights share one).

A view of a parameter (a transpose, a reshape) is the parameter for this purpose: the
operator consuming the view is the one that reads it.
"""

from __future__ import annotations

from torch import fx

from autopart.ops.aten import VIEW_OPS, op_name
from autopart.ops.meta import PARAMS
from autopart.passes.runner import PassContext


def params_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    views_of: dict[fx.Node, str] = {}  # node -> the parameter it is a view of
    for node in gm.graph.nodes:
        if node.op == "get_attr" and str(node.target) in ctx.params:
            views_of[node] = ctx.params[str(node.target)]
            PARAMS.set(node, ())
            continue
        if node.op == "call_module":
            prefix = f"{node.target}."
            read = tuple(
                sorted({fqn for name, fqn in ctx.params.items() if name.startswith(prefix)})
            )
        else:
            read = tuple(sorted({views_of[a] for a in node.all_input_nodes if a in views_of}))
        if op_name(node, gm) in VIEW_OPS and len(read) == 1 and len(node.all_input_nodes) == 1:
            views_of[node] = read[0]
            read = ()
        PARAMS.set(node, read)
    return gm
