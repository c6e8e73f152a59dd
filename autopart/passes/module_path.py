"""The module path (FQN of the innermost nn.Module) each operator was called from."""

from __future__ import annotations

from torch import fx

from autopart.ops.meta import MODULE_PATH
from autopart.passes.runner import PassContext


def module_path_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    for node in gm.graph.nodes:
        MODULE_PATH.set(node, _module_path(node))
    return gm


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        return _clean(path)
    if node.op == "call_module":
        return str(node.target)
    if node.op == "get_attr":
        return str(node.target).rpartition(".")[0]
    return ""


def _clean(path: str) -> str:
    if path.startswith("_empty_nn_module_stack"):  # export's marker for "no module"
        return ""
    # fx.symbolic_trace records attribute access paths ("layers.0.fc"); export records
    # FQNs. Both may carry a "L['self']." style prefix from dynamo-produced graphs.
    for prefix in ("L['self'].", "L__self__."):
        if path.startswith(prefix):
            path = path[len(prefix) :]
    return path
