"""Batch normalization under a split of the batch over replicas: the rewrite that makes a
model whose batch norms run in training mode exact, or DDP's, where the batch is split
over dp × ep (the batch group, `MeshGroups.batch_group`).

Every training-mode `aten.batch_norm` over the batch (`batch_mixing.
reduced_over_replicas`) is retargeted, on the same operands, to

- `ops.batch_norm.global_batch_norm`: its statistics are those of the whole batch, one
  all-reduce of per-channel sums over the group in forward and one in backward, as
  `nn.SyncBatchNorm` does. Forward, backward and the running statistics then equal one
  device's on the whole batch, up to the order of the sums. Microbatches within a
  replica are refused by the planner (solver/pins.py): the first would be normalized
  before the last is computed;
- `ops.batch_norm.per_part_batch_norm` where the user asked for per-part statistics
  (`per_part_statistics=True`): each replica normalizes its own part by its own
  statistics, as DDP without SyncBatchNorm does, its running statistics first taken
  from the first replica's, as DDP's broadcast of buffers does.
"""

from __future__ import annotations

from torch import fx

from autopart.degrees import BATCH_AXES
from autopart.ops.batch_norm import (
    first_replica_bytes,
    forward_sum_bytes,
    global_batch_norm,
    per_part_batch_norm,
)
from autopart.ops.meta import COLLECTIVE, SHAPE, CollectiveInfo, TensorInfo
from autopart.passes.batch_mixing import reduced_over_replicas
from autopart.passes.runner import PassContext
from autopart.plan import Plan

# aten.batch_norm(input, weight, bias, running_mean, running_var, training, momentum,
# eps, cudnn_enabled): the operands both replacements take, and where momentum and eps lie.
_OPERANDS, _MOMENTUM, _EPS = 5, 6, 7


def splits_norms(plan: Plan) -> bool:
    """Whether the plan splits the batch its batch norms normalize over replicas."""
    return plan.degrees.batch_split > 1


def batch_norm_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    groups, per_part = ctx.rank.groups, ctx.rank.plan.per_part_statistics
    group = groups.batch_group().group_name
    axes = " × ".join(str(a) for a in BATCH_AXES if groups.size(a) > 1)
    for node in list(gm.graph.nodes):
        if reduced_over_replicas(node):
            _retarget(node, per_part, group)
            _record(node, per_part, group, axes)
    gm.graph.lint()
    gm.recompile()
    return gm


def _retarget(node: fx.Node, per_part: bool, group: str) -> None:
    """Retarget `node` in place, so that it keeps its module path, block, parameters
    and shape for the passes after this one."""
    args = node.args
    momentum = node.kwargs.get("momentum", args[_MOMENTUM] if len(args) > _MOMENTUM else 0.1)
    eps = node.kwargs.get("eps", args[_EPS] if len(args) > _EPS else 1e-5)
    node.target = per_part_batch_norm if per_part else global_batch_norm
    node.args = (*args[:_OPERANDS], momentum, eps, group)
    node.kwargs = {}


def _record(node: fx.Node, per_part: bool, group: str, axes: str) -> None:
    """The collective `node` now runs in forward, for the per-rank graph's report."""
    info = SHAPE.get(node.args[0]) if isinstance(node.args[0], fx.Node) else None
    if not isinstance(info, TensorInfo):
        return
    channels = int(info.shape[1])
    if per_part and isinstance(node.args[3], fx.Node):  # running statistics to take
        nbytes = first_replica_bytes(channels, info.dtype.itemsize)
        COLLECTIVE.set(node, CollectiveInfo("broadcast", axes, group, nbytes))
    elif not per_part:
        nbytes = forward_sum_bytes(channels)
        COLLECTIVE.set(node, CollectiveInfo("all_reduce", axes, group, nbytes))
