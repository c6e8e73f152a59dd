"""Expert parallelism: split each routed layer's experts over the ep ranks.

The batch is split over dp × ep (every ep rank routes its own tokens, as a data-parallel
rank does); the experts of each layer (`passes.experts.ExpertLayer`) are split over ep.
In every layer:

- the stacked expert weights, [E, ...], become this rank's E/ep experts, under the same
  FQN (`EP_SHARDED` names them, for the gradient sync and for reassembling them);
- the routed rows go to the ranks of their experts before the first grouped multiply
  (`ep_to_experts`), which runs over the rows this rank's experts received, with their
  own offsets (`ep_local_offsets`); the last one's rows go back to where they were
  routed from (`ep_from_experts`), in their original order;
- the router, the weighting of each expert's output and the load-balancing loss run on
  each rank's own tokens, untouched.

Under tp the tensor-parallel pass has already run each expert layer on its tp slices
with no collective inside it (the plan checks the layout does: `TpLayouts.
splits_experts`; typically the first grouped multiply column-parallel and the last
row-parallel, `tp_rules._grouped_contraction`): the tp ranks of an ep group route the
same rows, and this pass cuts each rank's run of experts (dim 0) out of its tp slices.

Nothing is dropped, so each expert computes the rows one device's would. The gradient
of an expert's weight on its rank sums the rows of every ep rank's tokens; the
data-parallel sync sums it over the dp replicas of that expert and divides by dp × ep,
as it divides the other weights' (averaged over all dp × ep ranks).
"""

from __future__ import annotations

from torch import fx
from torch.distributed.tensor import Shard

from autopart.degrees import Axis
from autopart.ops.expert_parallel import (
    ep_from_experts,
    ep_local_offsets,
    ep_route,
    ep_to_experts,
)
from autopart.ops.layout import captured_dim_order
from autopart.ops.meta import COLLECTIVE, EP_SHARDED, SHAPE, CollectiveInfo, TensorInfo, inherit
from autopart.passes.experts import ExpertLayer, expert_layers
from autopart.passes.runner import PassContext
from autopart.passes.tensor_parallel import shard_parameters


class NoExpertLayers(ValueError):
    """A plan with ep > 1 for a model in which autopart finds no routed expert layer."""


def expert_parallel_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    plan, groups = ctx.rank.plan, ctx.rank.groups
    group = groups.group_name(Axis.EP)
    layers = expert_layers(gm, ctx.params)
    if not layers:
        raise NoExpertLayers(
            f"the plan splits experts over ep = {plan.ep} ranks, but the model has no routed "
            "expert layer autopart recognizes (grouped multiplies over weights stacked by "
            "expert)"
            + (
                f", or tp = {plan.tp}'s layout gathers the stacked expert weights before their "
                "grouped multiplies instead of splitting them on their inner dims"
                if plan.tp > 1
                else ""
            )
            + ": plan it with ep = 1"
        )
    for layer in layers:
        if layer.experts % plan.ep:
            raise NoExpertLayers(
                f"ep = {plan.ep} does not divide the {layer.experts} experts of the layer at "
                f"{layer.offsets.name}: choose an ep that divides {layer.experts}"
            )
        _route_layer(gm, layer, group)
    sharded = frozenset(fqn for layer in layers for fqn in layer.params)
    places = {fqn: Shard(0) for fqn in sharded}
    shard_parameters(gm, ctx.params, places, {}, plan.ep, groups.rank(Axis.EP))
    EP_SHARDED.set(gm, sharded)
    gm.graph.lint()
    gm.recompile()
    return gm


def _route_layer(gm: fx.GraphModule, layer: ExpertLayer, group: str) -> None:
    graph, offsets = gm.graph, layer.offsets
    with graph.inserting_after(offsets):
        route = graph.call_function(ep_route, (offsets, group))
    with graph.inserting_after(route):
        local = graph.call_function(ep_local_offsets, (route, offsets))
    inherit(route, offsets, None)
    inherit(local, offsets, SHAPE.get(offsets))
    for mm in layer.matmuls:
        mm.replace_input_with(offsets, local)
    for entry in layer.entries:
        rows = entry.args[0]
        assert isinstance(rows, fx.Node), "an expert layer's entries read routed rows"
        with graph.inserting_before(entry):
            arrived = graph.call_function(ep_to_experts, (rows, route))
        inherit(arrived, entry, SHAPE.get(rows))
        _count(arrived, group, rows)
        entry.replace_input_with(rows, arrived)
    for exit in layer.exits:
        with graph.inserting_after(exit):
            back = graph.call_function(ep_from_experts, (exit, route, captured_dim_order(exit)))
        inherit(back, exit, SHAPE.get(exit))
        _count(back, group, exit)
        for user in [u for u in exit.users if u is not back]:
            user.replace_input_with(exit, back)


def _count(node: fx.Node, group: str, rows: fx.Node) -> None:
    """Record the all_to_all: its bytes are the routed rows' (an even routing's)."""
    info = SHAPE.get(rows, None)
    nbytes = info.nbytes if isinstance(info, TensorInfo) else 0
    COLLECTIVE.set(node, CollectiveInfo("all_to_all", Axis.EP.value, group, nbytes))
