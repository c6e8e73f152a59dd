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
- a routed mixture-of-experts layer (`passes.experts.TokenRegion`: its tokens viewed as
  rows, routed, sorted by expert, multiplied and combined, and viewed back) runs on
  the rank's own tokens as it is, its sizes of the whole sequence made local, unless
  something outside reads its routing (a load-balancing loss over every token);
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
import torch
from torch import fx
from torch.distributed.tensor import Shard

from autopart.batch import SEQ
from autopart.degrees import Axis
from autopart.ops.aten import ATTENTION_OPS, VIEW_OPS, op_name
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
from autopart.passes.experts import TokenRegion, expert_layers, token_region
from autopart.passes.placement_rewrite import CP_CONVERSIONS, PlacementRewriter
from autopart.passes.runner import PassContext
from autopart.passes.tp_decision import (
    Decision,
    LocalSize,
    NodePlacement,
    Operands,
    R,
    argument_leaves,
)
from autopart.passes.tp_propagate import Propagation, propagate
from autopart.policy import cp_gradients_in_sync

log = logging.getLogger("autopart.cp")


def context_parallel_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    plan, groups = ctx.rank.plan, ctx.rank.groups
    group = groups.group_name(Axis.CP)
    inputs = sequence_inputs(gm)
    seeds = {node.name: Shard(1) for node in inputs}
    regions = TokenRegions(gm, ctx.params, inputs)
    result = propagate(
        gm,
        ctx.params,
        {},
        plan.cp,
        input_places=seeds,
        context_parallel=True,
        decide_first=regions.decide,
    )
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

    def readers(node: fx.Node) -> list[tuple[fx.Node, fx.Node]]:
        """(value, reader) pairs of a parameter, through views of it (a transposed
        expert weight): the view's gradient is the weight's, rearranged."""
        pairs = []
        for user in node.users:
            if op_name(user) in VIEW_OPS and result.places.get(user) == R:
                pairs += readers(user)
            else:
                pairs.append((node, user))
        return pairs

    partial: dict[str, bool] = {}
    reads_of: dict[str, list[tuple[fx.Node, fx.Node]]] = {}
    for node in gm.graph.find_nodes(op="get_attr"):
        fqn = params.get(str(node.target))
        if fqn is None:
            continue
        for value, user in readers(node):
            decision = result.decisions.get(user)
            part = decision is not None and reads(value, user) <= decision.copy_to_group
            partial[fqn] = partial.get(fqn, True) and part
            reads_of.setdefault(fqn, []).append((value, user))
    summed = frozenset(fqn for fqn, part in partial.items() if part)
    for fqn in summed:
        for value, user in reads_of[fqn]:
            result.decisions[user].copy_to_group -= reads(value, user)
    return summed


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


class TokenRegions:
    """The routed layers' token regions (`passes.experts.TokenRegion`), run on this
    rank's tokens: rows are whatever tokens the rank holds, so every node of a region
    takes its operands as they are (no collective), a size of the whole sequence in it
    becomes this rank's (a range over the rows, a view back to [batch, seq, ...]), the
    views back are sharded on the sequence as their input was, and the weights the
    region reads get a part of their gradient (their tokens'), summed over cp as the
    other weights' are. A region whose input is not sharded on the sequence is walked
    as any other nodes are."""

    def __init__(
        self, gm: fx.GraphModule, params: Mapping[str, str], inputs: list[fx.Node]
    ) -> None:
        self.of: dict[fx.Node, TokenRegion] = {}
        self.local: dict[TokenRegion, bool] = {}
        self.sequence = _sequence_symbols(inputs)
        if not self.sequence:  # a static sequence: sizes in the region are plain ints
            return
        for layer in expert_layers(gm, params):
            found = token_region(layer)
            if found is not None:
                self.of.update(dict.fromkeys(found.nodes, found))

    def decide(self, ops: Operands) -> Decision | None:
        node = ops.node
        region = self.of.get(node)
        if region is None:
            return None
        if node in region.flattens and region not in self.local:
            self.local[region] = all(
                ops.places[i] == Shard(1) for i in ops.tensors if ops.flat[i] not in region.nodes
            )
        if not self.local.get(region):
            return None
        updates: dict[int, LocalSize] = {}
        for i, leaf in enumerate(ops.flat):
            if isinstance(leaf, fx.Node) and self._whole_sequence_size(leaf):
                updates[i] = LocalSize(leaf)
        weights = [i for i in ops.tensors if ops.places[i] == R and ops.flat[i] not in region.nodes]
        return Decision(
            output=_rows_placement(node),
            copy_to_group={i for i in weights if ops.grads[i]},
            updates=dict(updates),
        )

    def _whole_sequence_size(self, size: fx.Node) -> bool:
        """A size of the whole sequence, or proportional to it (read off the inputs,
        which stay whole for their size reads)."""
        value = size.meta.get("val")
        if not isinstance(value, torch.SymInt):
            return False
        if not value.node.expr.free_symbols & self.sequence:
            return False
        sources = [size]
        while sources:
            node = sources.pop()
            if op_name(node) == "sym_size":
                source = node.args[0]
                if not isinstance(source, fx.Node) or source.op != "placeholder":
                    return False  # read off a local tensor: local already
                continue
            sources.extend(node.all_input_nodes)
        return True


def _rows_placement(node: fx.Node) -> NodePlacement:
    """A region node's output: a view back sharded on the sequence, rows (and values
    made of them) as this rank's."""
    info = SHAPE.get(node, None)
    if isinstance(info, TensorInfo) and len(info.shape) >= 3:
        seq = sympy.sympify(info.shape[1])
        if seq.is_Symbol and seq.name == SEQ:
            return Shard(1)
    value = node.meta.get("val")
    if isinstance(value, (tuple, list)):
        return tuple(Shard(0) for _ in value)
    return Shard(0)


def _sequence_symbols(inputs: list[fx.Node]) -> set[sympy.Symbol]:
    """The exporter's symbols for the sequence lengths of `inputs` (dim 1), where they
    are symbolic."""
    found: set[sympy.Symbol] = set()
    for node in inputs:
        value = node.meta.get("val")
        size = value.shape[1] if isinstance(value, torch.Tensor) and value.dim() > 1 else None
        if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
            found.add(size.node.expr)
    return found
