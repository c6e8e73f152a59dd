"""Applying a walk's placements to the graph: the collectives and local sizes they need.

`tp_propagate` decides, node by node, the placement each operand must have over one
mesh axis; `PlacementRewriter` makes it so, in place, for the tensor-parallel and the
context-parallel passes alike:

- each operand that must change placement gets a collective node before its consumer
  (one per source and target, shared by all consumers), with `COLLECTIVE` metadata;
- size arguments are made local (a view to 32 heads becomes a view to 32/tp; a view
  to the sequence's symbolic length, to the length divided by cp);
- a rule's local operator replaces the node's (`ops.local_ops.LOCAL_OPS`), and returns
  its value in the node's captured dim order (`ops.layout`);
- a row-parallel product is reduced right after it (all-reduce, or reduce-scatter along
  the sequence under sequence parallelism), and its bias is added once, after that.

`Conversions` names the functions that move a value between placements: the axes
differ in how a shard is laid out (tp: contiguous slices; cp: each rank's two mirrored
chunks of the sequence), not in what the walk decides.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch import fx
from torch.distributed import GroupName
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.utils import _pytree as pytree

from autopart.degrees import Axis
from autopart.ops import collectives as c
from autopart.ops.aten import op_name
from autopart.ops.context_parallel import cp_gather, cp_shard
from autopart.ops.layout import captured_dim_order
from autopart.ops.local_ops import LOCAL_OPS
from autopart.ops.meta import COLLECTIVE, SHAPE, TP_PLACE, CollectiveInfo, inherit, tensor_info
from autopart.passes.tp_decision import LocalSize, NodePlacement, flatten_args
from autopart.passes.tp_propagate import Propagation


@dataclass(frozen=True)
class Conversions:
    """The functions that convert a value between placements over one axis, by the
    kind of collective (`CollectiveInfo.kind`); a kind an axis never needs is None."""

    axis: Axis
    slice: Callable[..., torch.Tensor]  # R -> S
    all_gather: Callable[..., torch.Tensor]  # S -> R
    reduce_scatter: Callable[..., torch.Tensor] | None  # P -> S
    all_to_all: Callable[..., torch.Tensor] | None  # S(a) -> S(b)


TP_CONVERSIONS = Conversions(Axis.TP, c.shard, c.all_gather, c.reduce_scatter, c.all_to_all)
# Sequence shards are mirrored chunks; weights are never sharded over cp, so no partial
# sums arise but those a reduction makes (all-reduced, whatever the layout).
CP_CONVERSIONS = Conversions(Axis.CP, cp_shard, cp_gather, None, None)


class PlacementRewriter:
    def __init__(
        self,
        gm: fx.GraphModule,
        result: Propagation,
        group: GroupName,
        degree: int,
        conversions: Conversions,
    ) -> None:
        self.gm, self.graph = gm, gm.graph
        self.result, self.group, self.degree = result, group, degree
        self.fns = conversions
        self.converted: dict[tuple, fx.Node] = {}
        self.local_sizes: dict[fx.Node, fx.Node] = {}

    def apply_all(self) -> None:
        for node in list(self.graph.nodes):
            if node in self.result.decisions:
                self.apply(node)

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
            flat[i] = self.local_size(value.size, node) if isinstance(value, LocalSize) else value
        node.args, node.kwargs = pytree.tree_unflatten(flat, spec)
        if decision.local_op:
            node.target = LOCAL_OPS[decision.local_op]
            node.args = (*node.args, self.group)
            node.kwargs = {**node.kwargs, "dim_order": captured_dim_order(node)}
        if decision.reduce_to is not None:
            self.reduce_after(node, decision.reduce_to, decision.has_bias)

    # -- sizes ------------------------------------------------------------------------

    def local_size(self, size: fx.Node, user: fx.Node) -> fx.Node:
        """The local length of a sharded dim whose whole length `size` gives: a size
        read off a tensor sharded on that dim is already local."""
        if _reads_local_size(size, self.result):
            return size
        if size not in self.local_sizes:
            with self.graph.inserting_before(user):
                local = self.graph.call_function(operator.floordiv, (size, self.degree))
            local.name = f"local_{size.name}"
            inherit(local, user)
            self.local_sizes[size] = local
        return self.local_sizes[size]

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
        g, fns = self.group, self.fns
        if isinstance(have, Replicate) and isinstance(want, Shard):
            return fns.slice, (src, want.dim, g), "slice"
        if isinstance(have, Shard) and isinstance(want, Replicate):
            return fns.all_gather, (src, have.dim, g), "all_gather"
        if isinstance(have, Partial) and isinstance(want, Replicate):
            return c.all_reduce, (src, g), "all_reduce"
        if isinstance(have, Partial) and isinstance(want, Shard) and fns.reduce_scatter:
            return fns.reduce_scatter, (src, want.dim, g), "reduce_scatter"
        if isinstance(have, Shard) and isinstance(want, Shard) and fns.all_to_all:
            return fns.all_to_all, (src, want.dim, have.dim, g), "all_to_all"
        raise ValueError(f"cannot convert {have} to {want} over {fns.axis}")

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
        axis = self.fns.axis.value
        what = fn.__name__.removeprefix(f"{axis}_")
        node.name = f"{axis}_{what}_{src.name}" + (f"_for_{sharer.name}" if sharer else "")
        inherit(node, user, SHAPE.get(src))
        info = CollectiveInfo(kind, axis, self.group, self._bytes(src, have))
        COLLECTIVE.set(node, info)
        return node

    def _bytes(self, src: fx.Node, have: Placement) -> sympy.Expr:
        info = tensor_info(src)
        local = info.nbytes / self.degree if isinstance(have, Shard) else info.nbytes
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
            if isinstance(target, Shard) and isinstance(bias, fx.Node):
                # Each rank adds the bias to its own tokens alone: its gradient is a
                # partial sum of the whole's.
                last.replace_input_with(bias, self.copy_to_group(bias, last))
        for user in users:
            user.replace_input_with(node, last)
        axis = self.fns.axis.value
        reduced.name = f"{axis}_{kind}_{node.name}"
        inherit(reduced, node, SHAPE.get(node))
        info = CollectiveInfo(kind, axis, self.group, tensor_info(node).nbytes)
        COLLECTIVE.set(reduced, info)


def _reads_local_size(size: fx.Node, result: Propagation) -> bool:
    """Whether `size` is `sym_size(x, d)` of an intermediate `x` sharded on d (whose
    local tensor has the local length). Inputs stay whole for the sizes read off them:
    the context-parallel pass shards them for every other reader."""
    if size.target is not torch.ops.aten.sym_size.int or len(size.args) < 2:
        return False
    src, dim = size.args[0], size.args[1]
    if not isinstance(src, fx.Node) or src.op == "placeholder" or not isinstance(dim, int):
        return False
    place = result.operand_place(src)
    rank = len(tensor_info(src).shape)
    return isinstance(place, Shard) and _normalize(place, rank) == Shard(dim % rank)


def _sharer(src: fx.Node, user: fx.Node) -> fx.Node | None:
    """Who shares a conversion of `src`: every consumer of an activation; each consumer
    of a parameter its own, so that a tied weight read in two pipeline stages (the
    embedding and the head) is converted in each, not passed between them."""
    return user if src.op == "get_attr" else None


def _normalize(p: Placement, rank: int) -> Placement:
    return Shard(p.dim + rank) if isinstance(p, Shard) and p.dim < 0 else p
