"""The rewrite stage: from the captured graph and a plan to this rank's program.

    capture assertions            dropped (local shards and autocast change sizes, dtypes)
    causal attention              explicit causal masks back to `is_causal=True`
    tensor parallelism (tp > 1)   shard parameters, insert tp collectives (whole graph)
    pipeline split (pp > 1)       cut the graph into stages, keep this rank's
    materialize                   real memory for this rank's pieces of a meta model
    recompute                     the plan's blocks run under activation checkpointing
    ZeRO-3 (zero = 3)             shard each stage's parameters over dp; gather on use

Each step is a pass with the usual contract; the plan and this rank's coordinates reach
them through `ctx.options` (`plan`, `groups`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx

from autopart.capture import Captured
from autopart.passes.causal_attention import causal_attention_pass
from autopart.passes.pipeline_split import split_stages
from autopart.passes.recompute import recompute_pass
from autopart.passes.runner import PassContext
from autopart.passes.tensor_parallel import tensor_parallel_pass
from autopart.passes.zero import zero3_pass
from autopart.plan import Plan
from autopart.runtime.groups import MeshGroups
from autopart.runtime.weights import Weights, materialize


@dataclass
class RankProgram:
    """This rank's stage graphs: the whole graph when pp = 1; with a pipeline, the
    stages this rank runs (several under an interleaved schedule), by stage index."""

    stages: list[fx.GraphModule]
    stage_ids: list[int]
    # Tensor-parallel parameters: FQN -> (sharded dim, parts of a fused weight).
    tp_layout: dict[str, tuple[int, int]] = field(default_factory=dict)


def rank_program(
    captured: Captured, plan: Plan, groups: MeshGroups, weights: Weights | None = None
) -> RankProgram:
    ctx = captured.context(plan=plan, groups=groups, example_args=captured.example_args)
    gm = drop_capture_assertions(captured.gm, ctx)
    gm = causal_attention_pass(gm, ctx)
    if plan.tp > 1:
        gm = tensor_parallel_pass(gm, ctx)
    if plan.pp > 1:
        stages, stage_ids = split_stages(gm, ctx)
    else:
        stages, stage_ids = [gm], [0]
    materialize(stages, weights, ctx.options.get("tp_layout", {}), groups.tp_mesh, groups.device)
    stages = [retarget_devices(stage, groups.device) for stage in stages]
    if groups.device.type != "cpu":
        stages = [stage.to(groups.device) for stage in stages]
    if plan.recompute:
        stages = [recompute_pass(stage, ctx) for stage in stages]
    if plan.zero == 3:
        stages = [zero3_pass(stage, ctx) for stage in stages]
    return RankProgram(stages, stage_ids, ctx.options.get("tp_layout", {}))


def drop_capture_assertions(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Remove export's checks of the sizes and dtypes seen at capture: local shards have
    other sizes, and autocast other dtypes. Subgraphs of higher-order operators too."""
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in list(module.graph.nodes):
            if node.target is torch.ops.aten._assert_tensor_metadata.default and not node.users:
                module.graph.erase_node(node)
        module.recompile()
    return gm


def retarget_devices(gm: fx.GraphModule, device: torch.device) -> fx.GraphModule:
    """Point device arguments baked in at capture (`arange(..., device=meta)`) at this
    rank's device, in the graph and in the subgraphs of higher-order operators."""

    def retarget(value: object) -> object:
        if isinstance(value, torch.device) and value != device:
            return device
        return value

    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.nodes:
            node.args = fx.node.map_aggregate(node.args, retarget)
            node.kwargs = fx.node.map_aggregate(node.kwargs, retarget)
        module.recompile()
    return gm
