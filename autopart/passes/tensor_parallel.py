"""Tensor parallelism: shard parameters per the plan and insert the tp collectives.

The placements come from the plan (one per parameter on the tp axis); `tp_propagate`
carries them through the graph, and `placement_rewrite` applies what it decided, in
place (collectives, local sizes, row-parallel reductions). This pass adds:

- every sharded parameter is replaced by this rank's slice (part by part for a fused
  q/k/v weight), keeping its FQN.
- the graph's outputs are gathered whole, except the logits of a standard cross-entropy
  loss (`RankTarget.loss`) where the layout shards them over the vocabulary: they stay
  sharded, and the runtime's vocabulary-parallel cross-entropy reads the slices
  (recorded under `VOCAB_PARALLEL_LOSS`).

Operators with no rule replicate their inputs and warn once per operator.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping

from torch import fx, nn
from torch.distributed.tensor import Placement, Shard

from autopart.degrees import Axis
from autopart.ops.aten import op_name
from autopart.ops.meta import (
    TP_LAYOUT,
    TP_PLACE,
    VOCAB_PARALLEL_LOSS,
)
from autopart.ops.shards import local_shard
from autopart.passes.placement_rewrite import TP_CONVERSIONS, PlacementRewriter
from autopart.passes.runner import PassContext
from autopart.passes.tp_decision import NO_RULE, flatten_args
from autopart.passes.tp_propagate import Propagation, propagate

log = logging.getLogger("autopart.tp")


def tensor_parallel_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    plan, groups = ctx.rank.plan, ctx.rank.groups
    places = {fqn: plan.placement(fqn, Axis.TP) for fqn in sorted(set(ctx.params.values()))}
    loss = ctx.rank.loss
    logits = loss.logits if loss is not None else None
    result = propagate(gm, ctx.params, places, plan.tp, plan.sequence_parallel, logits)
    _warn_fallbacks(gm, result)
    if loss is not None and _logits_left_sharded(gm, result, loss.logits):
        VOCAB_PARALLEL_LOSS.set(gm, loss)
    for node, place in result.places.items():
        if isinstance(place, Placement):
            TP_PLACE.set(node, place)
    rewriter = PlacementRewriter(gm, result, groups.group_name(Axis.TP), plan.tp, TP_CONVERSIONS)
    rewriter.apply_all()
    shard_parameters(gm, ctx.params, places, result.fused, plan.tp, groups.rank(Axis.TP))
    # How each sharded parameter was cut, for reassembling it (checkpoints, full_state_dict).
    layout = {
        fqn: (p.dim, result.fused.get(fqn, 1)) for fqn, p in places.items() if isinstance(p, Shard)
    }
    TP_LAYOUT.set(gm, layout)
    gm.graph.lint()
    gm.recompile()
    return gm


def _logits_left_sharded(gm: fx.GraphModule, result: Propagation, leaf: int) -> bool:
    """Whether the walk left the graph's `leaf`-th output, the logits of a standard
    cross-entropy, sharded over the vocabulary (`tp_propagate.decide_node`)."""
    (output,) = gm.graph.find_nodes(op="output")
    flat, _ = flatten_args(output)
    if leaf >= len(flat) or not isinstance(flat[leaf], fx.Node):
        return False
    sharded = isinstance(result.operand_place(flat[leaf]), Shard)
    return sharded and leaf not in result.decisions[output].inputs


def _warn_fallbacks(gm: fx.GraphModule, result: Propagation) -> None:
    """Warn once per operator that has no sharding rule: it runs whole on every tp rank,
    which the user may want to know (and a rule would avoid). Other fallbacks (a weight
    sharded for memory and gathered for its operator) are layout choices the solver
    priced; they are logged."""
    seen: dict[str, str] = {}
    for node, reason in result.fallbacks:
        seen.setdefault(op_name(node, gm), reason)
    for op, reason in seen.items():
        message = (
            f"autopart: tensor parallelism replicates the inputs of {op} ({reason}); "
            "it is computed redundantly on every tp rank"
        )
        if reason.startswith(NO_RULE):
            warnings.warn(message, stacklevel=2)
        else:
            log.info(message)


def shard_parameters(
    gm: fx.GraphModule,
    names: Mapping[str, str],
    places: Mapping[str, Placement],
    fused: Mapping[str, int],
    tp: int,
    rank: int,
) -> None:
    """Replace every tp-sharded parameter by this rank's slice, under the same FQN."""
    shards: dict[str, nn.Parameter] = {}
    for attr, fqn in names.items():
        place = places.get(fqn)
        if not isinstance(place, Shard):
            continue
        if fqn not in shards:
            full = gm.get_parameter(attr)
            local = local_shard(full.detach(), place.dim, tp, rank, fused.get(fqn, 1))
            shards[fqn] = nn.Parameter(local.clone(), requires_grad=full.requires_grad)
        module_path, _, leaf = attr.rpartition(".")
        module = gm.get_submodule(module_path) if module_path else gm
        setattr(module, leaf, shards[fqn])
