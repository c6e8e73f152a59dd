"""Activation recomputation: the plan's recomputed blocks keep only their inputs.

Each block instance the plan names (`model.layers.3`) is outlined into a submodule that
runs under `torch.utils.checkpoint` (non-reentrant): forward saves only the block's
inputs, and backward runs the block's forward again to get what its gradients need.
Parameters stay attributes of the stage (read outside, passed in), so their FQNs, the
optimizer and the gradient sync are untouched; collectives inside a block run again in
backward, on every rank alike. Under ZeRO-3 (whose pass runs after this one) what is
passed in is the gathered parameters, which the checkpoint saves as tokens: the
recomputation gathers them again, as backward does (ops/zero3.py).

Selective recomputation: for the blocks in the plan's `recompute_attention`, only each
attention core (`attention_core`: scores, mask, softmax, dropout, weighted values) is
outlined so, and the rest of the block saves what it always does.
"""

from __future__ import annotations

import operator
from typing import Any

from torch import fx, nn
from torch.utils.checkpoint import checkpoint

from autopart.ops.meta import MODULE_PATH, PARAMS, inherit
from autopart.passes.attention_core import attention_cores
from autopart.passes.runner import PassContext


class Recomputed(nn.Module):
    """Runs `body` under non-reentrant activation checkpointing."""

    def __init__(self, body: fx.GraphModule) -> None:
        super().__init__()
        self.body = body

    def forward(self, *args: Any) -> Any:
        return checkpoint(self.body, *args, use_reentrant=False)


def recompute_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    plan = ctx.rank.plan
    for index, path in enumerate(plan.recompute):
        region = [
            n
            for n in gm.graph.nodes
            if n.op in ("call_function", "call_method", "call_module")
            and _inside(MODULE_PATH.get(n, ""), path)
        ]
        if region:
            _outline(gm, region, f"recompute_{index}", path)
    selective = [p for p in plan.recompute_attention if p not in plan.recompute]
    cores = [
        region
        for region in attention_cores(gm)
        if any(_inside(MODULE_PATH.get(region[0], ""), p) for p in selective)
    ]
    for index, region in enumerate(cores):
        _outline(gm, region, f"recompute_attention_{index}", MODULE_PATH.get(region[0], ""))
    gm.graph.lint()
    gm.recompile()
    return gm


def _inside(module_path: str, block: str) -> bool:
    return module_path == block or module_path.startswith(block + ".")


def _outline(gm: fx.GraphModule, region: list[fx.Node], name: str, path: str) -> None:
    members = set(region)
    inputs: list[fx.Node] = []
    for node in region:
        for arg in node.all_input_nodes:
            if arg not in members and arg not in inputs:
                inputs.append(arg)
    outputs = [n for n in region if any(u not in members for u in n.users)]

    body = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for arg in inputs:
        env[arg] = body.placeholder(arg.name)
        env[arg].meta = dict(arg.meta)
    for node in region:
        env[node] = body.node_copy(node, lambda n: env[n])
    body.output(tuple(env[n] for n in outputs))
    gm.add_submodule(name, Recomputed(fx.GraphModule(gm, body)))

    with gm.graph.inserting_after(region[-1]):
        call = gm.graph.call_module(name, tuple(inputs))
    inherit(call, region[0])
    PARAMS.set(call, tuple(sorted({p for n in region for p in PARAMS.get(n)})))
    previous = call
    for i, out in enumerate(outputs):
        with gm.graph.inserting_after(previous):
            item = gm.graph.call_function(operator.getitem, (call, i))
        item.meta = dict(out.meta)
        PARAMS.set(item, ())
        out.replace_all_uses_with(item, delete_user_cb=lambda user: user not in members)
        previous = item
    for node in reversed(region):
        gm.graph.erase_node(node)
