"""What one operator's tensor-parallel decision costs: its compute share, the
activations it saves, and the collectives it needs, priced on the tp axis.

A decision (`passes.tp_rules.Decision`) comes from the same rules the rewrite applies,
so these are the costs of what will run:

- compute: the operator runs on 1/tp of the work when any operand or its output is
  sharded or partial, unless it falls back (`split_by`), else in full on every rank;
- saved activations: split likewise, unless its activation operands are all
  replicated (a column-parallel product saves its whole input);
- collectives, forward and backward, as `ops/collectives.py` pairs them:

      conversion            forward          backward (when a gradient flows)
      S -> R  all_gather    all-gather       (own slice)
      R -> S  shard         (own slice)      all-gather
      P -> R  all_reduce    all-reduce       -
      P -> S  reduce_scatter reduce-scatter  all-gather
      S -> S  all_to_all    all-to-all       all-to-all
      gather_for_grad       all-gather       reduce-scatter
      copy_to_group         -                all-reduce
      row-parallel output   all-reduce (or reduce-scatter under sequence parallelism,
                            with an all-gather back)
      sharded logits        3 all-reduces of one fp32 value a token (the runtime's
                            vocabulary-parallel cross-entropy) -

  with the local copies the runtime makes around them (`comm.LOCAL_COPY`): a gather
  along a dim d > 0 concatenates its pieces (the whole tensor; none where every dim
  before d is 1, the pieces then being a view), a reduce-scatter along d > 0 does so to
  its input, a rank's own slice along d copies its share (none where every dim before d
  is 1), and an all-to-all stacks its send buffer and concatenates what it receives;

An activation's conversion is shared by every consumer that asks for the same target
(the rewrite inserts it once), so those are reported with the key the rewrite uses; a
parameter's conversion belongs to its consumer (a tied weight may be read in two
pipeline stages) and is part of the operator's own cost.
Under mixed precision, activations travel in 16 bits.

Memory is priced in seconds at the rate recomputation exchanges the two
(`memory_price`): a byte of activations costs what recomputing it would take, so the
solver weighs a layout that saves memory against one that saves time on one scale.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import sympy
from torch import fx
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from autopart.cost_models.comm import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    LOCAL_COPY,
    REDUCE_SCATTER,
)
from autopart.cost_models.memory import STATE_BYTES
from autopart.cost_models.precision import is_mixed
from autopart.cost_models.work import NodeWork, evaluate, is_low_precision, node_work
from autopart.ops.meta import BLOCK, SHAPE, TensorInfo
from autopart.passes.blocks import block_counterparts
from autopart.passes.tp_decision import Decision, Operands, R

if TYPE_CHECKING:
    from autopart.cost_models.choices import CostModels

COPY = "copy_to_group"
# A rank keeping its own slice of a replicated tensor: no collective, a local copy.
OWN_SLICE = "own_slice"
# The runtime's vocabulary-parallel cross-entropy (`ops/vocab_parallel_loss.py`) reduces
# one fp32 value a token three times in forward: the max, the sum of exponentials and
# the target's logit; its backward is local.
LOSS_ALL_REDUCES = 3


@dataclass(frozen=True, slots=True)
class TpCollective:
    """One collective a decision inserts, in the comm model's convention for `nbytes`
    (the whole buffer on one rank, as captured)."""

    op: str
    nbytes: sympy.Expr | float
    backward: bool
    activation: bool  # travels at the activations' precision (not a parameter)
    # How the rewrite shares it: one per (source, key) for an activation's conversion;
    # None for the operator's own (a row-parallel reduction, a parameter's conversion).
    source: fx.Node | None = None
    key: tuple = ()
    low_precision: bool = False  # the tensor was captured in 16 bits

    @property
    def mixed_scale(self) -> float:
        """Its bytes under mixed precision, over the captured ones: an activation
        captured in fp32 travels in 16 bits (1/2); a parameter's conversion in fp32,
        and a 16-bit capture as it is (1)."""
        return 0.5 if self.activation and not self.low_precision else 1.0


def collectives_of(
    ops: Operands, decision: Decision, output_grad: bool, mirrored: bool = False
) -> list[TpCollective]:
    """The collectives the rewrite inserts for `decision` on `ops.node`, forward and
    backward (a backward one only where a gradient flows). `mirrored`: context
    parallelism's layout, each rank holding two mirrored chunks of the sequence
    (`ops/context_parallel.py`), so that its gathers reorder what arrives and its own
    slices join two chunks: each a copy more."""
    out: list[TpCollective] = []
    node, tp = ops.node, ops.degree  # for sizes alone, past `DegreeReads`: it decides nothing
    for i, want in decision.inputs.items():
        have, source = ops.places[i], ops.flat[i]
        if have is None or isinstance(have, tuple) or _same(have, want, source):
            continue
        scatter = i in decision.gather_grad
        key = (str(want), scatter, str(have))
        full = _nbytes(source)
        dim = _shard_dim(want if isinstance(want, Shard) else have, source)
        for op, backward in _conversion(have, want, scatter, ops.grads[i]):
            nbytes = full / tp if op == ALL_TO_ALL else full  # the send buffer: a shard
            if op != OWN_SLICE:
                out.append(_of_operand(source, op, nbytes, backward, key))
            copied = _copied(op, nbytes, tp, dim, source, mirrored)
            if copied != 0:
                out.append(_of_operand(source, LOCAL_COPY, copied, backward, key))
    for i in decision.copy_to_group:
        if ops.grads[i]:
            source = ops.flat[i]
            out.append(_of_operand(source, ALL_REDUCE, _nbytes(source), True, (COPY,)))
    if decision.reduce_to is not None:
        full = _nbytes(node)
        low = is_low_precision(SHAPE.get(node))
        if decision.reduce_to == R:
            out.append(TpCollective(ALL_REDUCE, full, False, True, low_precision=low))
        else:
            dim = _shard_dim(decision.reduce_to, node)
            steps = [(REDUCE_SCATTER, False)] + [(ALL_GATHER, True)] * output_grad
            for op, backward in steps:
                out.append(TpCollective(op, full, backward, True, low_precision=low))
                copied = _copied(op, full, tp, dim, node)
                if copied != 0:
                    out.append(TpCollective(LOCAL_COPY, copied, backward, True, low_precision=low))
    if node.op == "output":
        out += _sharded_logits_loss(ops, decision)
    return out


def _sharded_logits_loss(ops: Operands, decision: Decision) -> list[TpCollective]:
    """The loss's all-reduces over an output leaf the graph leaves sharded (the logits
    of a cross-entropy, `tp_propagate.decide_node`): one fp32 value a token each."""
    out = []
    for i in ops.tensors:
        info = ops.shapes[i]
        if i in decision.inputs or ops.places[i] == R or info is None or not info.shape:
            continue
        per_token = info.numel / info.shape[-1] * 4
        out += [TpCollective(ALL_REDUCE, per_token, False, False)] * LOSS_ALL_REDUCES
    return out


def _of_operand(
    source: fx.Node, op: str, nbytes: sympy.Expr | float, backward: bool, key: tuple
) -> TpCollective:
    """A collective on an operand: an activation's is shared by the consumers asking
    for the same one; a parameter's is its consumer's own and travels in fp32."""
    activation = source.op != "get_attr"
    low = is_low_precision(SHAPE.get(source))
    return TpCollective(op, nbytes, backward, activation, source if activation else None, key, low)


def _conversion(
    have: Placement, want: Placement, scatter: bool, grad: bool
) -> list[tuple[str, bool]]:
    """(collective, in backward) of converting `have` to `want` (`ops/collectives.py`)."""
    if scatter:
        steps = [(ALL_GATHER, False), (REDUCE_SCATTER, True)]
    elif isinstance(have, Shard) and isinstance(want, Replicate):
        steps = [(ALL_GATHER, False), (OWN_SLICE, True)]
    elif isinstance(have, Replicate) and isinstance(want, Shard):
        steps = [(OWN_SLICE, False), (ALL_GATHER, True)]
    elif isinstance(have, Partial) and isinstance(want, Replicate):
        steps = [(ALL_REDUCE, False)]
    elif isinstance(have, Partial) and isinstance(want, Shard):
        steps = [(REDUCE_SCATTER, False), (ALL_GATHER, True)]
    else:
        steps = [(ALL_TO_ALL, False), (ALL_TO_ALL, True)]
    return [(op, backward) for op, backward in steps if grad or not backward]


def _copied(
    op: str,
    nbytes: sympy.Expr | float,
    tp: int,
    dim: int | None,
    source: fx.Node,
    mirrored: bool = False,
) -> sympy.Expr | float:
    """The bytes the runtime copies locally around `op` of `nbytes` along `dim` (the
    shard dim, None for none): `funcol`'s gather and reduce-scatter along a dim other
    than 0, `ops/collectives.py`'s own slice and all-to-all; under `mirrored`, the
    reordering of a gather and the joining of a slice's two chunks besides."""
    if op == ALL_TO_ALL:
        return 2 * nbytes  # the send buffer stacked, what arrives concatenated
    if mirrored and op == OWN_SLICE:
        return nbytes / tp
    info = SHAPE.get(source)
    reorder = nbytes if mirrored and op == ALL_GATHER else 0
    if op == ALL_REDUCE or not dim or not isinstance(info, TensorInfo):
        return reorder
    if op == REDUCE_SCATTER:
        return nbytes
    copies = _pieces_copied(tuple(info.shape[:dim]))
    return copies * (nbytes / tp if op == OWN_SLICE else nbytes) + reorder


@functools.lru_cache(maxsize=1024)  # a layout asks of the same few shapes at every node
def _pieces_copied(leading_dims: tuple) -> sympy.Expr:
    """1 where a dim before the split one exceeds 1, else 0 (the pieces are then
    views), given the dims before it."""
    leading = sympy.Mul(*(sympy.sympify(d) for d in leading_dims))
    return sympy.Min(1, leading - 1)


def _shard_dim(place: Placement, source: fx.Node) -> int | None:
    """The dim `place` shards of `source`'s output, counted from 0."""
    if not isinstance(place, Shard):
        return None
    info = SHAPE.get(source)
    if place.dim < 0 and isinstance(info, TensorInfo):
        return place.dim + len(info.shape)
    return place.dim


def _nbytes(node: fx.Node) -> sympy.Expr | float:
    info = SHAPE.get(node)
    return info.nbytes if isinstance(info, TensorInfo) else 0.0


@dataclass(frozen=True, slots=True)
class Conversion:
    """An activation's conversion, shared by the consumers that ask for the same one."""

    source: fx.Node
    key: tuple
    seconds: float


@dataclass(frozen=True, slots=True)
class DecisionCost:
    seconds: float  # compute, and the collectives that are the operator's own
    saved_bytes: float  # activations saved for backward on one rank
    split: bool  # runs on 1/tp of the work
    conversions: tuple[Conversion, ...]


class TpCosts:
    """Prices decisions of `gm`'s operators at the sizes `dims` over `tp` ranks."""

    def __init__(
        self,
        gm: fx.GraphModule,
        models: CostModels,
        dims: Mapping[str, int],
        tp: int,
    ) -> None:
        self.gm, self.models, self.dims, self.tp = gm, models, dims, tp
        self.param_bytes = {k: p.numel() * p.element_size() for k, p in gm.named_parameters()}
        self.mixed = is_mixed(models.compute.precision)
        self._works: dict[tuple[fx.Node, bool, bool], NodeWork] = {}

    # -- one operator ------------------------------------------------------------------

    def of(self, ops: Operands, decision: Decision, output_grad: bool) -> DecisionCost:
        node = ops.node
        split = split_by(ops, decision)
        seconds, saved = 0.0, 0.0
        if node.op not in ("output", "placeholder", "get_attr"):
            activations = [i for i in ops.tensors if ops.flat[i].op != "get_attr"]
            replicated = not any(distributed(ops.places[i]) for i in activations)
            work = self.work(node, split, saves_replicated=split and replicated)
            seconds = self.models.compute.time(work).total
            saved = work.saved_bytes
        shared: dict[tuple, Conversion] = {}
        for c in collectives_of(ops, decision, output_grad):
            t = self.seconds(c)
            if c.source is None:
                seconds += t
            else:
                k = (c.source, c.key)
                total = shared[k].seconds + t if k in shared else t
                shared[k] = Conversion(c.source, c.key, total)
        return DecisionCost(seconds, saved, split, tuple(shared.values()))

    def work(self, node: fx.Node, split: bool, saves_replicated: bool = False) -> NodeWork:
        """One rank's work: the whole operator, or its 1/tp share (saving its whole
        input where `saves_replicated`)."""
        key = (node, split, saves_replicated)
        if key not in self._works:
            work = node_work(node, self.gm, self.dims, self.param_bytes, split)
            work = replace(work, tp_saves_replicated=saves_replicated)
            self._works[key] = work.sharded(self.tp) if split else work
        return self._works[key]

    def seconds(self, c: TpCollective) -> float:
        scale = c.mixed_scale if self.mixed else 1.0
        return self.models.comm.time(c.op, evaluate(c.nbytes, self.dims) * scale, self.tp)

    # -- memory --------------------------------------------------------------------------

    def state_bytes(self, fqn: str, place: Placement) -> float:
        """A parameter's weights, gradient and optimizer state on one rank."""
        per_param = sum(STATE_BYTES[self.models.compute.precision])
        numel = self.param_bytes[fqn] / self.gm.get_parameter(fqn).element_size()
        return numel * per_param / (self.tp if isinstance(place, Shard) else 1)

    def memory_price(self) -> float:
        """Seconds per byte: what recomputation takes to free a byte of the repeated
        blocks' activations (of the whole graph where it has no blocks)."""
        copies = block_counterparts(self.gm)  # priced as their first copy: left out
        nodes = [n for n in self.gm.graph.nodes if n.op == "call_function" and n not in copies]
        in_blocks = [n for n in nodes if BLOCK.get(n) is not None]
        seconds = saved = 0.0
        for node in in_blocks or nodes:
            work = self.work(node, False)
            seconds += self.models.compute.forward_time(work)
            saved += work.saved_bytes
        return seconds / saved if saved else 0.0


def distributed(place: object) -> bool:
    """Sharded or partial (a multi-output operator: any of its outputs)."""
    if isinstance(place, tuple):
        return any(distributed(p) for p in place)
    # Not `place != R`: a Shard's comparison with a Replicate costs microseconds, and
    # the search asks this of every operand of every layout.
    return place is not None and not isinstance(place, Replicate)


def split_by(ops: Operands, decision: Decision) -> bool:
    """Whether an operator runs on 1/tp of the work: an operand or its output is
    sharded or partial, and it is not a fallback (which gathers and computes whole)."""
    if decision.fallback:
        return False
    return distributed(decision.output) or any(distributed(ops.places[i]) for i in ops.tensors)


def _same(have: Placement, want: Placement, source: fx.Node) -> bool:
    if have == want:
        return True
    rank = len(info.shape) if isinstance(info := SHAPE.get(source), TensorInfo) else 0
    norm = [Shard(p.dim + rank) if isinstance(p, Shard) and p.dim < 0 else p for p in (have, want)]
    return norm[0] == norm[1]
