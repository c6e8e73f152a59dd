"""Propagating tp placements through a graph, from the parameters' placements.

One walk in graph order applies `tp_rules.decide` to every operator. It only records:
the same walk lets the solver try placements (dry run, counting fallbacks) and lets the
rewrite pass apply them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import sympy
from torch import fx
from torch.distributed.tensor import Placement, Shard

from autopart.batch import SEQ
from autopart.ops.aten import VIEW_OPS, WEIGHT_PRODUCTS, op_name
from autopart.ops.meta import SHAPE, AnalysisMissing, TensorInfo
from autopart.ops.params import trainable_names
from autopart.passes.blocks import block_counterparts
from autopart.passes.tp_decision import (
    Decision,
    DegreeReads,
    LocalSize,
    NodePlacement,
    Operands,
    P,
    R,
    argument_leaves,
    fallback,
)
from autopart.passes.tp_rules import decide

log = logging.getLogger("autopart.tp")


@dataclass
class Propagation:
    """The outcome of one walk."""

    places: dict[fx.Node, NodePlacement] = field(default_factory=dict)  # output placement(s)
    decisions: dict[fx.Node, Decision] = field(default_factory=dict)
    grads: dict[fx.Node, bool] = field(default_factory=dict)
    # Column-parallel weights whose output is later split into equal parts (fused q/k/v):
    # parameter FQN -> number of parts, so they are sharded part by part.
    fused: dict[str, int] = field(default_factory=dict)
    # Replicated weights that a row-parallel product needs sharded: FQN -> dim.
    wants_row: dict[str, int] = field(default_factory=dict)
    # What each decision was made from (`operands_of` at its turn in the walk): what
    # a reader of the walk would build again from `places` and `grads`.
    operands: dict[fx.Node, Operands] = field(default_factory=dict)
    # What the rules read of the degree: where else the decisions hold.
    reads: DegreeReads = field(default_factory=DegreeReads)

    @property
    def fallbacks(self) -> list[tuple[fx.Node, str]]:
        return [(n, d.fallback) for n, d in self.decisions.items() if d.fallback]

    def operand_place(self, node: fx.Node) -> NodePlacement:
        return self.places.get(node, R)


def propagate(
    gm: fx.GraphModule,
    param_names: Mapping[str, str],
    param_places: Mapping[str, Placement],
    tp: int,
    sequence_parallel: bool = False,
    sharded_logits: int | None = None,
    input_places: Mapping[str, Placement] | None = None,
    context_parallel: bool = False,
) -> Propagation:
    """Walk `gm` with parameters placed as `param_places` (FQN -> tp placement) and
    inputs as `input_places` (placeholder name -> placement; replicated where absent). Under
    `sequence_parallel`, row-parallel outputs of shape [batch, seq, ...] are
    reduce-scattered along the sequence instead of all-reduced. `sharded_logits`: the
    graph output leaf a vocabulary-parallel cross-entropy reads (`decide_node`)."""
    result = Propagation()
    origin: dict[fx.Node, tuple[str, ...]] = {}  # column outputs -> weight (and bias) FQNs
    counterparts = _counterparts(gm)
    decided: dict[fx.Node, Decision] = {}  # the rules' answers, before the walk's checks
    trainable = trainable_names(gm)
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            fqn = param_names.get(str(node.target))
            result.places[node] = param_places.get(fqn, R) if fqn else R
            result.grads[node] = bool(fqn) and str(node.target) in trainable
            if fqn:
                origin[node] = (fqn,)
            continue
        if node.op == "placeholder":
            result.places[node] = (input_places or {}).get(node.name, R)
            result.grads[node] = False
            continue
        ops = result.operands[node] = operands_of(
            node, result.places, result.grads, tp, context_parallel, result.reads
        )
        decision = _as_in_first_copy(ops, counterparts.get(node), result, decided)
        if decision is None:
            decision = decide_node(ops, gm, sequence_parallel, sharded_logits)
        decided[node] = decision
        if decision.fused_split and ops.flat[ops.tensors[0]] not in origin:
            # The parts of a dim sharded by no product this walk can cut part by part
            # (a bias added in between, say): the local parts would not pair up.
            decision = fallback(ops, "a split into parts of a dim no fused weight shards")
        result.decisions[node] = decision
        result.places[node] = decision.output
        result.grads[node] = any(ops.grads[i] for i in ops.tensors)
        _track_origins(node, ops, decision, origin, result, gm)
    for node, reason in result.fallbacks:
        log.debug("tp fallback at %s (%s): %s", node.name, op_name(node, gm), reason)
    return result


def _counterparts(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """`block_counterparts`, or none on a graph whose blocks were never found."""
    try:
        return block_counterparts(gm)
    except AnalysisMissing:
        return {}


def _as_in_first_copy(
    ops: Operands,
    first: fx.Node | None,
    result: Propagation,
    decided: Mapping[fx.Node, Decision],
) -> Decision | None:
    """The rules' answer for the same operator in the first copy of its repeated block,
    where that copy met the same operands (placements, gradients, shapes, constants):
    the rules read nothing else, so an 80-block model costs one block's rules. None
    where there is no such answer, or it names a node of its own (a size to divide)."""
    if first is None or first not in decided:
        return None
    seen = result.operands[first]
    if seen.places != ops.places or seen.grads != ops.grads or seen.shapes != ops.shapes:
        return None
    if len(seen.flat) != len(ops.flat) or any(
        isinstance(a, fx.Node) != isinstance(b, fx.Node) or (not isinstance(a, fx.Node) and a != b)
        for a, b in zip(seen.flat, ops.flat)
    ):
        return None
    answer = decided[first]
    if any(isinstance(v, LocalSize) for v in answer.updates.values()):
        return None
    return answer.copy()


def gradient_flow(gm: fx.GraphModule, param_names: Mapping[str, str]) -> dict[fx.Node, bool]:
    """Which nodes' values need a gradient: trainable parameters and whatever is
    computed from them (the `grads` a walk records, without deciding placements)."""
    grads: dict[fx.Node, bool] = {}
    trainable = trainable_names(gm)
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            grads[node] = str(node.target) in param_names and str(node.target) in trainable
        else:
            grads[node] = any(grads.get(n, False) for n in node.all_input_nodes)
    return grads


def decide_node(
    ops: Operands,
    gm: fx.GraphModule,
    sequence_parallel: bool = False,
    sharded_logits: int | None = None,
) -> Decision:
    """`tp_rules.decide`, and what a walk adds to it: the graph's outputs are made
    replicated, and under `sequence_parallel` a row-parallel product of shape
    [batch, seq, ...] is reduce-scattered along the sequence instead of all-reduced.
    The output leaf `sharded_logits`, the logits of a standard cross-entropy, stays as
    it is where it is sharded evenly over the vocabulary (its last dim): the runtime's
    vocabulary-parallel cross-entropy reads the slices, and no rank gathers them."""
    node = ops.node
    if node.op == "output":
        inputs: dict[int, Placement] = {i: R for i in ops.tensors if ops.places[i] != R}
        if sharded_logits is not None and vocabulary_sharded(ops, sharded_logits):
            del inputs[sharded_logits]
        return Decision(output=R, inputs=inputs)
    if sequence_parallel:
        scattered = _scatter_partials(ops, gm)
        if scattered is not None:
            return scattered
    decision = decide(ops, gm)
    if sequence_parallel and decision.reduce_to == R and _seq_divisible(node, ops):
        decision.reduce_to = decision.output = Shard(1)
    return decision


def _scatter_partials(ops: Operands, gm: fx.GraphModule) -> Decision | None:
    """Under sequence parallelism, partial sums of shape [batch, seq, ...] (a
    vocabulary-parallel embedding's lookup) are reduce-scattered along the sequence
    rather than all-reduced, as a row-parallel product's are: every block then takes
    its input sharded on the sequence, the first as the others. None where no operand
    is such a partial, or the operator has no rule for the shards."""
    partial = [i for i in ops.tensors if ops.places[i] == P]
    if not partial or not all(
        isinstance(ops.flat[i], fx.Node) and _seq_divisible(ops.flat[i], ops) for i in partial
    ):
        return None
    places = [Shard(1) if p == P else p for p in ops.places]
    try:
        decision = decide(dataclasses.replace(ops, places=places), gm)
    except (AssertionError, ValueError, TypeError, IndexError):
        return None
    decision.inputs = {**{i: Shard(1) for i in partial}, **decision.inputs}
    return decision


def vocabulary_sharded(ops: Operands, leaf: int) -> bool:
    """Whether operand `leaf` is sharded evenly over its last dim."""
    if leaf not in ops.tensors:
        return False
    place, info = ops.places[leaf], ops.shapes[leaf]
    if not isinstance(place, Shard) or info is None:
        return False
    rank = len(info.shape)
    vocab = sympy.sympify(info.shape[-1])
    last = place.dim in (-1, rank - 1)
    return last and bool(vocab.is_Integer) and ops.divides(int(vocab))


def operands_of(
    node: fx.Node,
    places: Mapping[fx.Node, NodePlacement],
    grads: Mapping[fx.Node, bool],
    tp: int,
    context_parallel: bool = False,
    reads: DegreeReads | None = None,
) -> Operands:
    """`node`'s operands with the placements `places` gives their producers (R where it
    gives none) and whether they require grad; `reads`: where a walk records what its
    rules read of the degree."""
    flat = argument_leaves(node)
    operand_places: list[NodePlacement | None] = []
    shapes: list[TensorInfo | None] = []
    operand_grads: list[bool] = []
    for leaf in flat:
        info = SHAPE.get(leaf, None) if isinstance(leaf, fx.Node) else None
        is_tensor = isinstance(leaf, fx.Node) and (
            isinstance(info, TensorInfo) or isinstance(places.get(leaf), tuple)
        )
        operand_places.append(places.get(leaf, R) if is_tensor else None)
        shapes.append(info if isinstance(info, TensorInfo) else None)
        operand_grads.append(bool(is_tensor and grads.get(leaf, False)))
    return Operands(node, flat, operand_places, shapes, operand_grads, tp, context_parallel, reads)


def _track_origins(
    node: fx.Node,
    ops: Operands,
    decision: Decision,
    origin: dict[fx.Node, tuple[str, ...]],
    result: Propagation,
    gm: fx.GraphModule,
) -> None:
    """Remember which column-parallel weights produced a sharded value, through views,
    so a split of the sharded dim can mark those weights as fused."""
    name = op_name(node, gm)
    sources = [ops.flat[i] for i in ops.tensors]
    if name in WEIGHT_PRODUCTS and isinstance(decision.output, Shard):
        origin[node] = tuple(fqn for s in sources if s in origin for fqn in origin[s])
    elif name in VIEW_OPS | {"view", "_unsafe_view"} and sources and sources[0] in origin:
        origin[node] = origin[sources[0]]
    if decision.fused_split and sources and sources[0] in origin:
        for fqn in origin[sources[0]]:
            result.fused[fqn] = decision.fused_split
    for i, target in decision.inputs.items():
        leaf = ops.flat[i]
        if (
            isinstance(target, Shard)
            and ops.places[i] == R
            and name in ("linear", "addmm", "mm")
            and isinstance(leaf, fx.Node)
            and leaf.op == "get_attr"
            and leaf in origin
        ):
            result.wants_row[origin[leaf][0]] = target.dim


def _seq_divisible(node: fx.Node, ops: Operands) -> bool:
    """Whether the sequence dim can be split over tp: a fixed size tp divides, or the
    dynamic "seq" (the runtime refuses a batch whose sequence tp does not divide)."""
    info = SHAPE.get(node)
    if not isinstance(info, TensorInfo) or len(info.shape) < 3:
        return False
    seq = sympy.sympify(info.shape[1])
    return (seq.is_Symbol and seq.name == SEQ) or (seq.is_Integer and ops.divides(int(seq)))
