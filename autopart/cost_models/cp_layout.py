"""Which operators context parallelism runs on the whole sequence, and the collectives
its rewrite inserts for them, as `passes/context_parallel.py` decides.

The cp rewrite walks the graph with the sharding rules from the sequence-sharded
inputs (`passes.context_parallel.cp_propagation`); `CpLayouts.at` runs the same
walk. An operator with an operand or its output sharded over the sequence (or
the partial sums of a reduction over it) runs on this rank's tokens (`tp_costs.split_by`,
tp's own test); any other runs on the whole sequence, as one device runs it:

- where a rule falls back, the operands sharded over the sequence are gathered over cp
  and what they feed runs whole on every rank, until an operator meets a sequence
  shard again and takes this rank's chunks of it (a slice; in backward, its gradient
  gathered). A mixture-of-experts layer that flattens [batch, seq] into rows for its
  router runs whole from that view to the residual add after it (router, routing,
  every expert's rows); so does attention that the ring does not take
  (`tp_rules._ring_attention`: a mask, dropout, causal attention over unequal query
  and key lengths), with the projection after it;
- values computed from shapes alone (positions, rotary tables) are whole on every
  rank, as they are.

Causal masks. Traced, a Hugging Face decoder hands attention an explicit causal mask
built from aranges; the rewrite's first pass (`passes/causal_attention.py`) evaluates
it on the example inputs and, where it is lower-triangular, replaces it by
`is_causal=True`, which the ring takes. The cost models cannot evaluate a mask (on the
meta device, or over a long sequence), so they take a mask that pass would evaluate
(attention's plain (q, k, v, mask) form) and that is a function of the shapes alone
(its ancestry reads no parameter and no input but for its sizes) as causal: the walk
runs on a copy of the graph with those masks dropped, and what only they read, as the
rewrite drops them. A mask passed in as an input, or computed from the data or from
weights, stays, and its attention gathers. A shape-only mask that is not causal (a
sliding window) is priced as a ring, which the runtime would gather.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
from torch import fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from autopart.cost_models.tp_costs import COPY, TpCollective, collectives_of, split_by
from autopart.ops.params import parameter_names
from autopart.passes.causal_attention import MASK_ARG, shape_only_mask
from autopart.passes.context_parallel import cp_propagation
from autopart.passes.tp_propagate import Propagation


@dataclass(frozen=True)
class CpLayout:
    """The cp rewrite's layout of a graph at some number of cp ranks: the operators
    (of the graph given) that run on the whole sequence, and the collectives its
    conversions insert, each with the operator it serves, once (a conversion of an
    activation is shared by its consumers, as the rewrite shares it). Left out are
    those `context.py` prices apart: the weights' gradient all-reduces
    (`gradient_all_reduces`) and the outputs' gather (`output_gather`); ring attention
    is a local operator, with no conversion."""

    whole: frozenset[fx.Node]
    collectives: tuple[tuple[TpCollective, fx.Node], ...]


class CpLayouts:
    """The `CpLayout`s of one graph, made once per number of cp ranks, on one copy of
    the graph as the rewrite sees it: the search prices many plans of a graph, under
    several tp layouts, at a few cp degrees. One walk serves every degree at which its
    decisions hold (`DegreeReads.holds_at`: its rules asked only whether the degree
    divides sizes, and each answers alike), its collectives sized at each."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self._layouts: dict[int, CpLayout] = {}
        self._walks: list[Propagation] = []
        # The graph as the rewrite sees it, its nodes' originals, the parameters' FQNs.
        self._rewritten: tuple[fx.GraphModule, dict[fx.Node, fx.Node], dict[str, str]] | None
        self._rewritten = None

    def at(self, cp: int) -> CpLayout:
        if cp not in self._layouts:
            if self._rewritten is None:
                params = parameter_names(self.gm)
                self._rewritten = (*_as_rewritten(self.gm), params)
            walked, original, params = self._rewritten
            walk = next((w for w in self._walks if w.reads.holds_at(cp)), None)
            if walk is None:
                walk = cp_propagation(walked, params, cp)
                self._walks.append(walk)
            self._layouts[cp] = _layout(walk, original, cp)
        return self._layouts[cp]


def _layout(walk: Propagation, original: Mapping[fx.Node, fx.Node], cp: int) -> CpLayout:
    """The layout of the cp rewrite's walk at `cp` ranks (made at `cp`, or at a degree
    where its decisions are the same), read back onto the nodes of the graph it copies
    (`original`)."""
    whole: set[fx.Node] = set()
    found: dict[tuple, tuple[TpCollective, fx.Node]] = {}
    for node, decision in walk.decisions.items():
        if node.op == "output":
            continue
        site = original[node]
        ops = walk.operands[node]
        if ops.degree != cp:
            ops = replace(ops, degree=cp, reads=None)  # the collectives' sizes at `cp`
        if not split_by(ops, decision):
            whole.add(site)
        for k, c in enumerate(collectives_of(ops, decision, walk.grads[node], mirrored=True)):
            if c.key == (COPY,):
                continue
            if c.source is None:
                found.setdefault((site, k), (c, site))
                continue
            source = original[c.source]
            key = (source, c.key, c.op, c.backward)
            found.setdefault(key, (replace(c, source=source), site))
    return CpLayout(frozenset(whole), tuple(found.values()))


def _as_rewritten(gm: fx.GraphModule) -> tuple[fx.GraphModule, dict[fx.Node, fx.Node]]:
    """`gm` as the cp rewrite will see it, its shape-only masks dropped (on a copy,
    where it has any), and each node of it -> the node of `gm` it stands for."""
    causal = [node for node in gm.graph.nodes if shape_only_mask(gm, node)]
    if not causal:
        return gm, {node: node for node in gm.graph.nodes}
    graph = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten._assert_tensor_metadata.default and not node.users:
            continue  # dropped before (`passes/retarget.py` `drop_capture_assertions_pass`)
        copies[node] = graph.node_copy(node, copies.__getitem__)
    for node in causal:
        attention = copies[node]
        attention.args = attention.args[:MASK_ARG]
        attention.kwargs = {**attention.kwargs, "is_causal": True}
    graph.eliminate_dead_code()
    alive = set(graph.nodes)
    original = {copy: node for node, copy in copies.items() if copy in alive}
    # Walked, never run: its Python code is generated on first use, not here.
    return _LazyGraphModule(gm, graph), original
