"""Making the captured graph run on this rank: what capture baked in for the example
inputs on the capturing device is loosened or pointed at the rank's device."""

from __future__ import annotations

import torch
from torch import fx

from autopart.passes.runner import PassContext


def drop_capture_assertions_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Remove export's checks of the sizes and dtypes seen at capture: local shards have
    other sizes, and autocast other dtypes. Subgraphs of higher-order operators too."""
    for module in _graph_modules(gm):
        for node in list(module.graph.nodes):
            if node.target is torch.ops.aten._assert_tensor_metadata.default and not node.users:
                module.graph.erase_node(node)
        module.recompile()
    return gm


def retarget_devices_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Point device arguments baked in at capture (`arange(..., device=meta)`) at this
    rank's device, in the graph and in the subgraphs of higher-order operators, and
    move the stage's tensors there."""
    device = ctx.rank.groups.device

    def retarget(value: fx.node.Argument) -> fx.node.Argument:
        if isinstance(value, torch.device) and value != device:
            return device
        return value

    for module in _graph_modules(gm):
        for node in module.graph.nodes:
            node.args = fx.node.map_aggregate(node.args, retarget)
            node.kwargs = fx.node.map_aggregate(node.kwargs, retarget)
        module.recompile()
    return gm.to(device) if device.type != "cpu" else gm


def _graph_modules(gm: fx.GraphModule) -> list[fx.GraphModule]:
    return [m for m in gm.modules() if isinstance(m, fx.GraphModule)]
