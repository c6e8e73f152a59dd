"""Context parallelism: shard every sequence over the cp ranks; attention runs as a ring.

The inputs whose dim 1 is the sequence (token ids, labels, position ids) are sharded
over cp in the mirrored layout (`ops.context_parallel`): each rank computes its two
chunks of every sequence. The walk that places tensor parallelism (`tp_propagate`)
places the sequence shards through the graph from those inputs, with the parameters
whole:

- operators that act on each token alone (projections, norms, activations) run on the
  local chunks; sizes of the sequence become local;
- values computed from the whole sequence's shape (positions, rotary tables) are whole
  on every rank and sliced to its chunks where they meet a sharded value;
- causal (or unmasked) attention over sequence shards runs as ring attention;
- a replicated weight applied to the local tokens gets a part of its gradient on each
  cp rank (its tokens'). Under plain data parallelism the sync sums the parts over dp ×
  cp once per step, bucketed and overlapped with backward (`CP_SUMMED`,
  `policy.cp_gradients_in_sync`); otherwise (ZeRO, local SGD, compression) each is
  all-reduced over cp in backward as it is produced (`copy_to_group`). Either way every
  rank steps on the whole gradient, as one device has it;
- anything else that mixes tokens (a masked attention, a reduction over the sequence,
  a slice of it) gathers the sequence first and runs whole: correct, and slower, and
  logged;
- the graph's outputs are gathered whole, so the loss is one device's.

Sizes read off the inputs (`sym_size`) stay whole: the inputs themselves stay whole for
those readers, and every other reader takes this rank's chunks.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping

import sympy
from torch import fx
from torch.distributed.tensor import Shard

from autopart.batch import SEQ
from autopart.degrees import Axis
from autopart.ops.aten import ATTENTION_OPS, op_name
from autopart.ops.context_parallel import cp_shard
from autopart.ops.meta import (
    COLLECTIVE,
    CP_PLACE,
    CP_SUMMED,
    SHAPE,
    CollectiveInfo,
    TensorInfo,
    inherit,
    tensor_info,
)
from autopart.passes.placement_rewrite import CP_CONVERSIONS, PlacementRewriter
from autopart.passes.runner import PassContext
from autopart.passes.tp_decision import argument_leaves
from autopart.passes.tp_propagate import Propagation, propagate
from autopart.policy import cp_gradients_in_sync

log = logging.getLogger("autopart.cp")


def context_parallel_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    plan, groups = ctx.rank.plan, ctx.rank.groups
    group = groups.group_name(Axis.CP)
    inputs = sequence_inputs(gm)
    result = cp_propagation(gm, ctx.params, plan.cp)
    for node, reason in result.fallbacks:
        name = op_name(node, gm)
        log.info("cp: %s (%s) runs on the whole sequence: %s", node.name, name, reason)
        if name in ATTENTION_OPS:
            warnings.warn(
                f"autopart: context parallelism gathers the sequence for {node.name} "
                f"({reason}); it runs whole on every cp rank",
                stacklevel=2,
            )
    if cp_gradients_in_sync(plan.zero, plan.sync_every, plan.grad_compression):
        CP_SUMMED.set(gm, _leave_sums_to_sync(gm, result, ctx.params))
    for node, place in result.places.items():
        if isinstance(place, Shard) and node.op != "placeholder":
            CP_PLACE.set(node, place)
    PlacementRewriter(gm, result, group, plan.cp, CP_CONVERSIONS).apply_all()
    for node in inputs:
        _shard_input(gm, node, group)
    gm.graph.lint()
    gm.recompile()
    return gm


def _leave_sums_to_sync(
    gm: fx.GraphModule, result: Propagation, params: Mapping[str, str]
) -> frozenset[str]:
    """The parameters every reader of which applies them to this rank's tokens (so each
    rank's gradient is a part, its tokens'): their all-reduces over cp in backward are
    dropped, and the data-parallel sync sums them instead, once per step. A parameter
    also read whole (a position table looked up by whole positions) keeps them: its
    gradient is whole on every rank, and summing it would count it cp times."""

    def reads(node: fx.Node, user: fx.Node) -> set[int]:
        return {i for i, leaf in enumerate(argument_leaves(user)) if leaf is node}

    partial: dict[str, bool] = {}
    for node in gm.graph.find_nodes(op="get_attr"):
        fqn = params.get(str(node.target))
        if fqn is None:
            continue
        for user in node.users:
            decision = result.decisions.get(user)
            part = decision is not None and reads(node, user) <= decision.copy_to_group
            partial[fqn] = partial.get(fqn, True) and part
    summed = frozenset(fqn for fqn, part in partial.items() if part)
    for node in gm.graph.find_nodes(op="get_attr"):
        if params.get(str(node.target)) in summed:
            for user in node.users:
                result.decisions[user].copy_to_group -= reads(node, user)
    return summed


def cp_propagation(gm: fx.GraphModule, params: Mapping[str, str], cp: int) -> Propagation:
    """The sharding rules' walk of `gm` over `cp` ranks from its sequence inputs, split
    on the sequence (dim 1): what the rewrite applies, and the cost models read."""
    seeds = {node.name: Shard(1) for node in sequence_inputs(gm)}
    return propagate(gm, params, {}, cp, input_places=seeds, context_parallel=True)


def sequence_inputs(gm: fx.GraphModule) -> list[fx.Node]:
    """The graph's inputs whose dim 1 is the sequence: the capture names it (a dynamic
    sequence), or, captured static (a model on the meta device), token ids: integer
    tensors of 2 dims or more."""
    found = []
    for node in gm.graph.find_nodes(op="placeholder"):
        info = SHAPE.get(node, None)
        if not isinstance(info, TensorInfo) or len(info.shape) < 2:
            continue
        seq = sympy.sympify(info.shape[1])
        named = seq.is_Symbol and seq.name == SEQ
        if named or (seq.is_Integer and not info.dtype.is_floating_point):
            found.append(node)
    return found


def sequence_length(gm: fx.GraphModule, dims: Mapping[str, int]) -> int | None:
    """The length of the sequences the graph's inputs hold, at the named sizes `dims`;
    None where it has no such input, or they disagree."""
    lengths = set()
    for node in sequence_inputs(gm):
        size = sympy.sympify(tensor_info(node).shape[1])
        size = size.subs({s: dims[s.name] for s in size.free_symbols if s.name in dims})
        if not size.is_Integer:
            return None
        lengths.add(int(size))
    return lengths.pop() if len(lengths) == 1 else None


def _shard_input(gm: fx.GraphModule, node: fx.Node, group: str) -> None:
    """Every reader of `node` but its size reads takes this rank's chunks."""
    readers = [u for u in node.users if op_name(u, gm) not in ("sym_size", "sym_numel")]
    if not readers:
        return
    with gm.graph.inserting_after(node):
        local = gm.graph.call_function(cp_shard, (node, 1, group))
    local.name = f"cp_shard_{node.name}"
    inherit(local, readers[0], SHAPE.get(node))
    CP_PLACE.set(local, Shard(1))
    nbytes = tensor_info(node).nbytes
    COLLECTIVE.set(local, CollectiveInfo("slice", Axis.CP.value, group, nbytes))
    for user in readers:
        user.replace_input_with(node, local)
