"""Tensor parallelism: shard parameters per the plan and insert the tp collectives.

The placements come from the plan (one per parameter on the tp axis); `tp_propagate`
carries them through the graph, and this pass applies what it decided, in place:

- each operand that must change placement gets a collective node before its consumer
  (one per source and target, shared by all consumers), with `COLLECTIVE` metadata;
- size arguments are made local (a view to 32 heads becomes a view to 32/tp);
- a row-parallel product is reduced right after it (all-reduce, or reduce-scatter along
  the sequence under sequence parallelism), and its bias is added once, after that;
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
from collections.abc import Callable, Mapping
from typing import Any

import sympy
import torch
from torch import fx, nn
from torch.distributed import GroupName
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.utils import _pytree as pytree

from autopart.degrees import Axis
from autopart.ops import collectives as c
from autopart.ops.aten import op_name
from autopart.ops.meta import (
    COLLECTIVE,
    SHAPE,
    TP_LAYOUT,
    TP_PLACE,
    VOCAB_PARALLEL_LOSS,
    CollectiveInfo,
    inherit,
    tensor_info,
)
from autopart.ops.shards import local_shard
from autopart.ops.vocab_parallel import LOCAL_OPS
from autopart.passes.runner import PassContext
from autopart.passes.tp_decision import NO_RULE, NodePlacement, flatten_args
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
    rewriter = _Rewriter(gm, result, groups.group_name(Axis.TP), plan.tp)
    for node in list(gm.graph.nodes):
        if node in result.decisions:
            rewriter.apply(node)
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


class _Rewriter:
    def __init__(self, gm: fx.GraphModule, result: Propagation, group: GroupName, tp: int) -> None:
        self.gm, self.graph = gm, gm.graph
        self.result, self.group, self.tp = result, group, tp
        self.converted: dict[tuple, fx.Node] = {}

    def apply(self, node: fx.Node) -> None:
        decision = self.result.decisions[node]
        flat, spec = flatten_args(node)
        for i, target in decision.inputs.items():
            have = self.result.operand_place(flat[i])
            backward_scatter = i in decision.gather_grad
            flat[i] = self.convert(flat[i], have, target, node, backward_scatter)
        for i in decision.copy_to_group:
            flat[i] = self.copy_to_group(flat[i], node)
        for i, value in decision.updates.items():
            flat[i] = value
        node.args, node.kwargs = pytree.tree_unflatten(flat, spec)
        if decision.local_op:
            node.target = LOCAL_OPS[decision.local_op]
            node.args, node.kwargs = (*node.args, self.group), {}
        if decision.reduce_to is not None:
            self.reduce_after(node, decision.reduce_to, decision.has_bias)

    # -- conversions ------------------------------------------------------------------

    def convert(
        self,
        src: fx.Node,
        have: NodePlacement,
        want: Placement,
        user: fx.Node,
        backward_scatter: bool = False,
    ) -> fx.Node:
        rank = len(tensor_info(src).shape)
        assert isinstance(have, Placement), "a single tensor has a single placement"
        have, want = _normalize(have, rank), _normalize(want, rank)
        if have == want:
            return src
        key = (src, str(want), backward_scatter, _sharer(src, user))
        if key not in self.converted:
            if backward_scatter:  # sequence parallel: gather forward, reduce-scatter back
                assert isinstance(have, Shard), "only a sharded operand is gathered for grad"
                fn, args, kind = c.gather_for_grad, (src, have.dim, self.group), "all_gather"
            else:
                fn, args, kind = self._collective_for(src, have, want)
            self.converted[key] = self._insert(fn, args, kind, src, user, have)
        return self.converted[key]

    def _collective_for(
        self, src: fx.Node, have: Placement, want: Placement
    ) -> tuple[Callable[..., torch.Tensor], tuple[Any, ...], str]:
        g = self.group
        if isinstance(have, Replicate) and isinstance(want, Shard):
            return c.shard, (src, want.dim, g), "slice"
        if isinstance(have, Shard) and isinstance(want, Replicate):
            return c.all_gather, (src, have.dim, g), "all_gather"
        if isinstance(have, Partial) and isinstance(want, Replicate):
            return c.all_reduce, (src, g), "all_reduce"
        if isinstance(have, Partial) and isinstance(want, Shard):
            return c.reduce_scatter, (src, want.dim, g), "reduce_scatter"
        if isinstance(have, Shard) and isinstance(want, Shard):
            return c.all_to_all, (src, want.dim, have.dim, g), "all_to_all"
        raise ValueError(f"cannot convert {have} to {want}")

    def copy_to_group(self, src: fx.Node, user: fx.Node) -> fx.Node:
        key = (src, "copy_to_group", _sharer(src, user))
        if key not in self.converted:
            self.converted[key] = self._insert(
                c.copy_to_group, (src, self.group), "all_reduce (backward)", src, user, Replicate()
            )
        return self.converted[key]

    def _insert(
        self, fn: Callable, args: tuple, kind: str, src: fx.Node, user: fx.Node, have: Placement
    ) -> fx.Node:
        with self.graph.inserting_before(user):
            node = self.graph.call_function(fn, args)
        sharer = _sharer(src, user)
        node.name = f"tp_{fn.__name__}_{src.name}" + (f"_for_{sharer.name}" if sharer else "")
        inherit(node, user, SHAPE.get(src))
        info = CollectiveInfo(kind, Axis.TP.value, self.group, self._bytes(src, have))
        COLLECTIVE.set(node, info)
        return node

    def _bytes(self, src: fx.Node, have: Placement) -> sympy.Expr:
        info = tensor_info(src)
        local = info.nbytes / self.tp if isinstance(have, Shard) else info.nbytes
        return local

    # -- row-parallel reduction -------------------------------------------------------

    def reduce_after(self, node: fx.Node, target: Placement, has_bias: bool) -> None:
        """A row-parallel product: reduce its partial sums right after it (all-reduce,
        or reduce-scatter along the sequence), then add the bias, once."""
        bias = None
        if has_bias:  # linear(x, w, b) -> linear(x, w);  addmm(b, x, w) -> mm(x, w)
            if op_name(node, self.gm) == "linear":
                bias = node.args[2]
                node.args = node.args[:2]
            else:
                bias = node.args[0]
                node.target, node.args = torch.ops.aten.mm.default, node.args[1:3]
        # The product's own value is now a partial sum (of the unbiased product, where
        # the bias moved after the reduction: then no piece of the original value).
        TP_PLACE.set(node, Partial() if bias is None else None)
        users = list(node.users)
        with self.graph.inserting_after(node):
            if isinstance(target, Shard):
                reduced = self.graph.call_function(c.reduce_scatter, (node, target.dim, self.group))
                kind = "reduce_scatter"
            else:
                reduced = self.graph.call_function(c.all_reduce, (node, self.group))
                kind = "all_reduce"
        last = reduced
        if bias is not None:
            with self.graph.inserting_after(reduced):
                last = self.graph.call_function(torch.ops.aten.add.Tensor, (reduced, bias))
            inherit(last, node, SHAPE.get(node))
        for user in users:
            user.replace_input_with(node, last)
        reduced.name = f"tp_{kind}_{node.name}"
        inherit(reduced, node, SHAPE.get(node))
        info = CollectiveInfo(kind, Axis.TP.value, self.group, tensor_info(node).nbytes)
        COLLECTIVE.set(reduced, info)


def _sharer(src: fx.Node, user: fx.Node) -> fx.Node | None:
    """Who shares a conversion of `src`: every consumer of an activation; each consumer
    of a parameter its own, so that a tied weight read in two pipeline stages (the
    embedding and the head) is converted in each, not passed between them."""
    return user if src.op == "get_attr" else None


def _normalize(p: Placement, rank: int) -> Placement:
    return Shard(p.dim + rank) if isinstance(p, Shard) and p.dim < 0 else p


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
