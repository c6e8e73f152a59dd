"""An analyzed graph cut into segments and pre-aggregated, so pricing a plan is cheap.

A segment is one repeated-block instance (`model.layers.3`) or a run of consecutive
operators outside blocks that share a module path (`model.embed_tokens`, `lm_head`).
Pipeline stages are made of whole segments. Instances of one block are structurally
identical (same operators, shapes and relative parameters: see `passes.blocks`), so
their work is evaluated once, on the first instance, and shared: a 32-layer model costs
one layer's worth of sympy substitutions, not 32.

Tensor-parallel layout. With a plan's placements (`TpLayout`), an operator runs on 1/tp
of the work if any of its operands or outputs is sharded or partial as
`passes.tp_propagate` lays the graph out for the rewrite, and does not fall back
(`tp_costs.split_by`): the column- and row-parallel products and everything between
them, not the norms, the residual stream or a bias and dropout after a row-parallel
reduction, and not an LM head or embedding the plan leaves replicated; a parameter is
sharded if its placement says so. Each segment carries the tp collectives its operators
insert (`tp_costs.collectives_of`), which `predict` prices. What an operator saves for
backward is split too, unless all its activation operands are replicated: a
column-parallel product saves its whole input on every tp rank (the "10·s·b·h" of
Korthikanti et al., 2022, that tensor parallelism alone does not divide). Without placements (a
search pricing tp degrees before choosing any) the Megatron-LM layout is assumed: inside
a block, an operator is sharded if it lies in a sublayer (a direct child of the block,
such as the attention or the MLP) that holds a contraction; outside blocks the
contractions (a vocabulary-parallel LM head) are sharded and the rest replicated; a
parameter is sharded if a contraction or an embedding reads it.

Context parallelism (`context_parallel`): an operator the cp rewrite runs on the
sequence's shards is priced on 1/cp of the tokens (1/cp of the batch), one it runs on
the whole sequence (`cp_layout.py`) on all of them, and a segment carries the
collectives of the rewrite's conversions (`cp_traffic`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

import sympy
from torch import fx
from torch.distributed.tensor import Placement

from autopart.batch import BATCH
from autopart.cost_models.cp_layout import CpLayouts
from autopart.cost_models.precision import bytes_scale, is_mixed
from autopart.cost_models.tp_costs import TpCollective, collectives_of, distributed, split_by
from autopart.cost_models.work import (
    OTHER,
    NodeWork,
    cross_entropy_work,
    evaluate,
    node_work,
    op_kind,
)
from autopart.ops.aten import op_name
from autopart.ops.meta import (
    BLOCK,
    EXAMPLE_DIMS,
    MODULE_PATH,
    PARAMS,
    SHAPE,
    TensorInfo,
    tensor_info,
)
from autopart.ops.params import parameter_names
from autopart.passes.batch_mixing import (
    gathered_products,
    product_operands,
    reduced_over_replicas,
    replica_statistics,
    updates_running_statistics,
)
from autopart.passes.experts import expert_layers
from autopart.passes.product_rows import row_operands
from autopart.passes.tp_decision import R, flatten_args
from autopart.passes.tp_propagate import Propagation, propagate
from autopart.policy import Precision

_NO_WORK = ("placeholder", "get_attr", "output")
# Collectives priced together: (collective, bytes, in backward, bytes under mixed
# precision over the captured ones, how many).
Traffic = tuple[tuple[str, float, bool, float, int], ...]
# A collective's bytes, given the operator it serves (`GraphSummary._collective_bytes`).
_Bytes = Callable[[TpCollective, fx.Node | None], float]


@dataclass(frozen=True, slots=True)
class Segment:
    """Operators that stay together: a block instance or a run outside blocks."""

    key: str  # the block instance, or the module path of the run
    block_id: str | None
    nodes: tuple[fx.Node, ...]
    sharded: tuple[bool, ...]  # per node: split over the tensor-parallel axis
    saves_replicated: tuple[bool, ...]  # per node: split, but saving a replicated operand
    param_numel: int  # parameters first read here (tied weights counted once)
    sharded_param_numel: int  # of which split over the tensor-parallel axis
    param_tensors: int  # how many parameter tensors those are
    # FQNs of the parameters first read here, and of those read here but first read by
    # an earlier segment (a tied head reading the embedding).
    owned: tuple[str, ...] = ()
    borrowed: tuple[str, ...] = ()
    # The tensor-parallel collectives its operators insert under the plan's layout
    # (None: no layout given, the Megatron layout's are assumed), and for each the
    # operator it serves (the graph's output node for the outputs' gathers).
    tp_collectives: tuple[TpCollective, ...] | None = None
    tp_collective_sites: tuple[fx.Node, ...] = ()
    output_split: bool = False  # what it hands on is split over tp (sequence parallel)
    # Of `param_numel`, the stacked expert weights of its routed layers (split over ep),
    # and the bytes of the rows each of their all_to_alls moves, as captured
    # (`passes.experts`: the rows into the first grouped multiply, out of the last).
    expert_param_numel: int = 0
    expert_rows: tuple[sympy.Expr, ...] = ()
    sharded_expert_param_numel: int = 0  # of the experts, split over tp too
    # The channels of each batch norm that takes the whole batch's statistics over the
    # replicas where the batch is split (`passes/batch_norm.py`).
    norm_channels: tuple[int, ...] = ()
    # Bytes of each operand of a batch × batch product the batch-products rewrite
    # gathers over the replicas, of those of them that give the rows a loss over the
    # rows reads (each replica keeps its own: `passes/product_rows.py`), and of each
    # statistic the batch-statistics rewrite averages over them, where the batch is
    # split (`cost_models/batch_mixing.py`).
    gathered: tuple[sympy.Expr, ...] = ()
    gathered_rows: tuple[sympy.Expr, ...] = ()
    statistics: tuple[sympy.Expr, ...] = ()
    # It updates buffers in place (a batch norm's running statistics in training mode):
    # recomputed, it would update them twice, so it is never recomputed.
    updates_buffers: bool = False


@dataclass(frozen=True, slots=True)
class Totals:
    """What the search reads of a segment's operators for every plan, summed once per
    tuple of them: the copies of a block share their operators' tuple, and so these."""

    nodes: tuple[NodeWork, ...]
    flops: float
    # Bytes saved for backward, in fp32 and under mixed precision, eager and compiled
    # (indexed by 2 · `is_mixed` + compiled); those recomputing the attention cores
    # frees, in fp32 and under mixed precision (indexed by `is_mixed`).
    saved: tuple[float, ...]
    core_frees: tuple[float, ...]
    attention_core: tuple[NodeWork, ...]

    @classmethod
    def of(cls, nodes: tuple[NodeWork, ...]) -> Totals:
        precisions = (Precision.FP32, Precision.BF16_MIXED)
        saved = tuple(
            sum(
                (w.fused_saved_bytes if compiled else w.saved_bytes) * bytes_scale(w, p)
                for w in nodes
            )
            for p in precisions
            for compiled in (False, True)
        )
        frees = tuple(
            sum(w.core_frees_bytes * bytes_scale(w, p) for w in nodes) for p in precisions
        )
        core = tuple(w for w in nodes if w.in_attention_core)
        return cls(nodes, sum(w.flops for w in nodes), saved, frees, core)


@dataclass(frozen=True, slots=True)
class SegmentWork:
    """A segment's operators evaluated at one set of dim sizes."""

    segment: Segment
    nodes: tuple[NodeWork, ...]
    output_bytes: float  # the activation handed to the next segment (as captured)
    # (collective, bytes as captured, in backward, bytes under mixed precision over
    # the captured ones, how many): its tp collectives (`_traffic`)
    tp_traffic: Traffic | None = None
    # Bytes of the routed rows, summed over its expert layers' all_to_alls (as captured).
    expert_rows_bytes: float = 0.0
    # Under context parallelism, the collectives of the cp rewrite's conversions
    # (`cp_layout.py`: the sequence gathered for what runs whole), as `tp_traffic`.
    cp_traffic: Traffic = ()
    # Bytes of the operands its batch × batch products gather (as captured), and of
    # those of them a loss over the product's rows keeps local (`Segment.gathered_rows`).
    gathered_bytes: float = 0.0
    rows_bytes: float = 0.0
    # What the search reads of its operators for every plan, summed once (`Totals`).
    totals: Totals | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.totals is None or self.totals.nodes is not self.nodes:
            object.__setattr__(self, "totals", Totals.of(self.nodes))

    @property
    def key(self) -> str:
        return self.segment.key

    @property
    def is_block(self) -> bool:
        return self.segment.block_id is not None

    def _totals(self) -> Totals:
        assert self.totals is not None  # set by __post_init__
        return self.totals

    def saved_bytes(self, precision: str = "fp32", compiled: bool = False) -> float:
        """Bytes saved for backward per microbatch at `precision` (`precision.py`), by
        the eager program or the compiled one (`fusion.py`)."""
        return self._totals().saved[2 * is_mixed(precision) + compiled]

    def core_frees_bytes(self, precision: str = "fp32") -> float:
        """Bytes per microbatch that recomputing its attention cores alone frees
        (selective recomputation; 0 for a segment without one)."""
        return self._totals().core_frees[is_mixed(precision)]

    @property
    def has_attention_core(self) -> bool:
        totals = self._totals()
        return totals.core_frees[0] > 0 or bool(totals.attention_core)

    @property
    def attention_core(self) -> tuple[NodeWork, ...]:
        """The operators of its attention cores: one tuple, so their cost is kept with
        it (`ComputeModel.cost`)."""
        return self._totals().attention_core

    @property
    def flops(self) -> float:
        return self._totals().flops

    @property
    def low_precision_output(self) -> bool:
        """Whether the activation it hands on was captured in 16 bits."""
        return bool(self.nodes) and self.nodes[-1].low_precision

    @property
    def param_tensors(self) -> int:
        return self.segment.param_tensors

    def param_numel(self, tp: int = 1, ep: int = 1) -> float:
        """Parameters held by one rank of a `tp`-way tensor-parallel group, with the
        experts split over `ep` ranks."""
        s = self.segment
        held = s.param_numel - s.sharded_param_numel + s.sharded_param_numel / tp
        return held - self.expert_numel(1, tp) * (1 - 1 / ep)

    def expert_numel(self, ep: int = 1, tp: int = 1) -> float:
        """Of `param_numel`, the expert weights one rank of `ep` × `tp` holds (the
        layout may shard them over tp too: expert tensor parallelism)."""
        s = self.segment
        whole = s.expert_param_numel - s.sharded_expert_param_numel
        return (whole + s.sharded_expert_param_numel / tp) / ep

    def sharded(self, tp: int, twin: SegmentWork | None = None) -> SegmentWork:
        """One tp rank's share: its operators', and its output where the layout splits
        what it hands on (a block's output under sequence parallelism). `twin`: the
        share of another segment with these operators (a block's other instance)."""
        if tp == 1:
            return self
        output = self.output_bytes / (tp if self.segment.output_split else 1)
        if twin is not None:
            return replace(self, nodes=twin.nodes, output_bytes=output, totals=twin.totals)
        return replace(self, nodes=tuple(w.sharded(tp) for w in self.nodes), output_bytes=output)


@dataclass(frozen=True, slots=True)
class TpLayout:
    """A plan's tensor-parallel layout: the operators that run on 1/tp of the work and
    the FQNs of the parameters sharded over tp."""

    split: frozenset[fx.Node]
    saves_replicated: frozenset[fx.Node]  # split, with only replicated activation operands
    sharded_params: frozenset[str]
    collectives: Mapping[fx.Node, tuple[TpCollective, ...]]
    # The logits of a standard cross-entropy stay sharded over the vocabulary: the
    # runtime's vocabulary-parallel loss runs on each rank's slice.
    vocab_parallel_loss: bool
    # The walk the layout was read from, which the solver reads again (the parameters'
    # roles, whether expert layers stay whole) instead of walking the graph anew.
    walk: Propagation = field(compare=False, repr=False)

    @classmethod
    def of(
        cls,
        gm: fx.GraphModule,
        placements: Mapping[str, Placement],
        tp: int,
        sequence_parallel: bool = False,
        sharded_logits: int | None = None,
    ) -> TpLayout:
        """The layout the rewrite gives `gm` for parameters placed as `placements`
        (FQN -> tp placement) over `tp` ranks (`sharded_logits`: the output leaf a
        vocabulary-parallel cross-entropy reads, if any)."""
        result = propagate(
            gm, parameter_names(gm), placements, tp, sequence_parallel, sharded_logits
        )
        operands = result.operands
        decisions = result.decisions
        split = frozenset(n for n, d in decisions.items() if split_by(operands[n], d))
        collectives = {
            node: tuple(collectives_of(operands[node], decision, result.grads[node]))
            for node, decision in result.decisions.items()
        }
        saves_replicated = frozenset(
            node
            for node in split
            if not any(
                distributed(result.places.get(n, R))
                for n in node.all_input_nodes
                if n.op != "get_attr"
            )
        )
        sharded = frozenset(f for f, p in placements.items() if distributed(p))
        vocab_parallel = False
        if sharded_logits is not None:
            [output] = gm.graph.find_nodes(op="output")
            vocab_parallel = sharded_logits not in decisions[output].inputs and distributed(
                operands[output].places[sharded_logits]
            )
        return cls(split, saves_replicated, sharded, collectives, vocab_parallel, result)


class GraphSummary:
    """Segments of an analyzed graph, evaluated (and cached) per set of dim sizes, under
    a plan's tensor-parallel layout (None: the Megatron layout). `like`: a summary of
    the same graph under another layout, whose analysis of what needs no layout (the
    segments' runs and what they hold, the context-parallel layouts) this one shares.
    `loss_logits`: the output leaf a standard cross-entropy reads after the graph
    (`ops/loss_match.py`), whose work the last segment carries (`cross_entropy_work`):
    on each tp rank's vocabulary slice where the layout leaves the logits sharded, else
    whole; under context parallelism whole, the outputs gathered for it."""

    def __init__(
        self,
        gm: fx.GraphModule,
        layout: TpLayout | None = None,
        like: GraphSummary | None = None,
        loss_logits: int | None = None,
    ) -> None:
        assert like is None or like.gm is gm, "a summary shares the analysis of its own graph"
        self.gm: fx.GraphModule = gm
        params = dict(gm.named_parameters())
        self.param_bytes = {k: p.numel() * p.element_size() for k, p in params.items()}
        numel = {k: p.numel() for k, p in params.items()}
        self._runs: _Runs = like._runs if like is not None else _Runs.of(gm, numel)
        self.segments = _segments(gm, numel, layout, self._runs)
        self.captured_batch = _static_batch(gm)
        self.example_dims = EXAMPLE_DIMS.get(gm, {})
        self._cache: dict[tuple, tuple[SegmentWork, ...]] = {}
        self._node_works: _NodeWorks = (
            like._node_works if like is not None else _NodeWorks(gm, self.param_bytes)
        )
        self._sharded: dict[tuple, tuple[SegmentWork, ...]] = {}
        self.cp_layouts: CpLayouts = like.cp_layouts if like is not None else CpLayouts(gm)
        self._cp_sharded: dict[tuple, tuple[SegmentWork, ...]] = {}
        self._logits = _output_leaf(gm, loss_logits) if loss_logits is not None else None
        self._loss_split = layout is not None and layout.vocab_parallel_loss

    def sharded(self, dims: Mapping[str, float], tp: int) -> tuple[SegmentWork, ...]:
        """`evaluate(dims)` on one rank of a `tp`-way tensor-parallel group (cached)."""
        key = (tuple(sorted(dims.items())), tp)
        if key not in self._sharded:
            self._sharded[key] = _shares(self.evaluate(dims), tp)
        return self._sharded[key]

    def context_parallel(
        self, dims: Mapping[str, float], tp: int, cp: int
    ) -> tuple[SegmentWork, ...]:
        """`sharded(dims, tp)` on one rank of a `cp`-way context-parallel group (cached),
        `dims` holding the microbatch: the operators the cp rewrite runs on the
        sequence's shards on this rank's 1/cp of the tokens (priced as 1/cp of the
        batch), those it runs whole (`cp_layouts.at(cp).whole`) on the whole microbatch;
        each segment with the collectives of its conversions (`cp_traffic`)."""
        if cp == 1:
            return self.sharded(dims, tp)
        key = (tuple(sorted(dims.items())), tp, cp)
        if key not in self._cp_sharded:
            works = self._context_parallel(dims, cp)
            self._cp_sharded[key] = _shares(works, tp)
        return self._cp_sharded[key]

    def _context_parallel(self, dims: Mapping[str, float], cp: int) -> list[SegmentWork]:
        layout = self.cp_layouts.at(cp)
        local_dims = {**dims, BATCH: dims[BATCH] / cp}
        local, full = self.evaluate(local_dims), self.evaluate(dims)
        local_bytes, full_bytes = self._collective_bytes(local_dims), self._collective_bytes(dims)
        segment_of = {n: i for i, seg in enumerate(self.segments) for n in seg.nodes}
        conversions: list[list[TpCollective]] = [[] for _ in self.segments]
        for c, site in layout.collectives:
            i = segment_of.get(c.source) if c.source is not None else None
            conversions[segment_of[site] if i is None else i].append(c)

        def size(c: TpCollective, site: fx.Node | None) -> float:
            # A tp collective moves its tensor (an operator's own: its output) as the cp
            # rewrite leaves it: whole where that runs whole.
            whole = (c.source if c.source is not None else site) in layout.whole
            return (full_bytes if whole else local_bytes)(c, site)

        out = []
        mixed: dict[tuple, SegmentWork] = {}  # a block's copies mix their operators alike
        # A segment's tp traffic is its collectives' (`_signature`), each whole or not:
        # counted once for a block's copies.
        traffics: dict[tuple, Traffic | None] = {}
        for seg, mine, all_of, found in zip(self.segments, local, full, conversions):
            whole = tuple(n in layout.whole for n in seg.nodes)
            whole += (True,) * (len(mine.nodes) - len(whole))  # the loss after the graph
            if not any(whole) and not found:
                out.append(mine)
                continue
            twin = mixed.get((id(mine.nodes), whole))
            nodes = (
                twin.nodes
                if twin
                else tuple(
                    replace(w, cp_whole=True) if at_full else m
                    for m, w, at_full in zip(mine.nodes, all_of.nodes, whole)
                )
            )
            cp_traffic = _alike(((c, None) for c in found), full_bytes)
            wholes = tuple(
                (c.source if c.source is not None else site) in layout.whole
                for c, site in zip(seg.tp_collectives or (), seg.tp_collective_sites)
            )
            traffic_key = (seg.tp_collectives is None, _signature(seg), wholes)
            if traffic_key not in traffics:
                traffics[traffic_key] = _traffic(seg, size)
            work = replace(
                mine,
                nodes=nodes,
                tp_traffic=traffics[traffic_key],
                cp_traffic=cp_traffic,
                totals=twin.totals if twin else None,
            )
            mixed.setdefault((id(mine.nodes), whole), work)
            out.append(work)
        return out

    def evaluate(self, dims: Mapping[str, float]) -> tuple[SegmentWork, ...]:
        """Every segment's work at `dims` ({"batch": microbatch, "seq": ...}). A graph
        captured with a static batch is evaluated as captured and scaled linearly to
        `dims["batch"]`. A named dim not in `dims` is taken at its example size."""
        dims = {**self.example_dims, **dims}
        key = tuple(sorted(dims.items()))
        if key not in self._cache:
            self._cache[key] = self._evaluate(dims, key)
        return self._cache[key]

    def collective_sites(
        self, dims: Mapping[str, int]
    ) -> list[tuple[Segment, fx.Node, TpCollective, float]]:
        """Every tp collective of the layout with the operator it serves and its bytes
        at `dims` (as `evaluate` scales them), segment by segment."""
        size = self._collective_bytes(dims)
        return [
            (seg, site, c, size(c, site))
            for seg in self.segments
            if seg.tp_collectives is not None
            for c, site in zip(seg.tp_collectives, seg.tp_collective_sites)
        ]

    def _collective_bytes(self, dims: Mapping[str, float]) -> _Bytes:
        """A collective's bytes at `dims`, as `evaluate` scales them."""
        dims = {**self.example_dims, **dims}
        scale = self._scale(dims)
        return lambda c, _: evaluate(c.nbytes, dims) * (scale if c.activation else 1)

    def _scale(self, dims: Mapping[str, float]) -> float:
        """A static batch's factor to `dims`' batch (1 where the batch is dynamic)."""
        if self.captured_batch is not None and BATCH in dims:
            return dims[BATCH] / self.captured_batch
        return 1.0

    def _evaluate(self, dims: Mapping[str, float], key: tuple) -> tuple[SegmentWork, ...]:
        scale = self._scale(dims)
        size = self._collective_bytes(dims)
        # Each block's first instance and its collectives: its copies take its work.
        by_block: dict[str, tuple[SegmentWork, tuple]] = {}
        out: list[SegmentWork] = []
        for seg in self.segments:
            first = by_block.get(seg.block_id) if seg.block_id is not None else None
            if first is None:
                works = tuple(
                    self._node_work(n, dims, key, s, r, scale)
                    for n, s, r in zip(seg.nodes, seg.sharded, seg.saves_replicated)
                )
                output = _output_bytes(seg.nodes, dims) * scale
                rows = sum(evaluate(r, dims) for r in seg.expert_rows) * scale
                gathered = sum(evaluate(b, dims) for b in seg.gathered) * scale
                own = sum(evaluate(b, dims) for b in seg.gathered_rows) * scale
                work = SegmentWork(
                    seg,
                    works,
                    output,
                    _traffic(seg, size),
                    rows,
                    gathered_bytes=gathered,
                    rows_bytes=own,
                )
                if seg.block_id is not None:
                    by_block[seg.block_id] = (work, _signature(seg))
            else:
                twin, signature = first
                alike = _signature(seg) == signature  # else a copy with other collectives
                traffic = twin.tp_traffic if alike else _traffic(seg, size)
                work = replace(twin, segment=seg, tp_traffic=traffic)
            out.append(work)
        if self._logits is not None and out:
            loss = cross_entropy_work(tensor_info(self._logits), dims).scaled(scale)
            loss = replace(loss, tp_sharded=self._loss_split)
            out[-1] = replace(out[-1], nodes=(*out[-1].nodes, loss), totals=None)
        return tuple(out)

    def _node_work(
        self,
        node: fx.Node,
        dims: Mapping[str, float],
        key: tuple,
        sharded: bool,
        saves_replicated: bool,
        scale: float,
    ) -> NodeWork:
        """`node`'s work at `dims` (whose sorted items are `key`), scaled to the batch,
        with the layout's flags; kept for every summary of the graph."""
        shared = (key, node, sharded, saves_replicated)
        work = self._node_works.flagged.get(shared)
        if work is None:
            made = self._node_works.at(node, dims)
            work = replace(made, tp_sharded=sharded, tp_saves_replicated=saves_replicated)
            work = self._node_works.flagged[shared] = work.scaled(scale)
        return work


_ABSENT = object()  # a dim that the sizes given do not name


class _ReadDims(Mapping[str, float]):
    """Sizes of named dims that note which names are read (iterated: all of them)."""

    def __init__(self, dims: Mapping[str, float]) -> None:
        self.dims, self.read = dims, set[str]()

    def __getitem__(self, name: str) -> float:
        self.read.add(name)
        return self.dims[name]

    def __iter__(self) -> Iterator[str]:
        self.read.update(self.dims)
        return iter(self.dims)

    def __len__(self) -> int:
        self.read.update(self.dims)
        return len(self.dims)


class _NodeWorks:
    """The operators' work (`node_work`) of one graph, shared by its summaries under
    every tp layout. An operator's work is kept by the sizes of the dims it read,
    noted as it was made: made again where those agree, it would read the same and
    come out the same. So a graph captured with a static batch, which reads no batch
    (scaled to it after), is worked out once for every microbatch the search asks
    for; `flagged` keeps it scaled and with a layout's flags, by all the sizes."""

    def __init__(self, gm: fx.GraphModule, param_bytes: Mapping[str, int]) -> None:
        self.gm, self.param_bytes = gm, param_bytes
        # operator -> (the names it read, their sizes -> its work), per set of names
        self.kept: dict[fx.Node, list[tuple[tuple[str, ...], dict[tuple, NodeWork]]]] = {}
        self.flagged: dict[tuple, NodeWork] = {}

    def at(self, node: fx.Node, dims: Mapping[str, float]) -> NodeWork:
        kept = self.kept.setdefault(node, [])
        for names, works in kept:
            work = works.get(tuple(dims.get(name, _ABSENT) for name in names))
            if work is not None:
                return work
        reading = _ReadDims(dims)
        work = node_work(node, self.gm, reading, self.param_bytes)
        names = tuple(sorted(reading.read))
        by_sizes = dict(kept).get(names)
        if by_sizes is None:
            by_sizes = {}
            kept.append((names, by_sizes))
        by_sizes[tuple(dims.get(name, _ABSENT) for name in names)] = work
        return work


def _shares(works: Iterable[SegmentWork], tp: int) -> tuple[SegmentWork, ...]:
    """Each segment's share on one rank of `tp` (`SegmentWork.sharded`), the operators
    that copies of a block share sharded once."""
    done: dict[int, SegmentWork] = {}
    out = []
    for work in works:
        out.append(work.sharded(tp, done.get(id(work.nodes))))
        done.setdefault(id(work.nodes), out[-1])
    return tuple(out)


_Run = tuple[str, str | None, list[fx.Node]]  # (key, block id, operators)


@dataclass(frozen=True)
class _Runs:
    """What a graph's segments are and hold, whatever its tensor-parallel layout: the
    runs of operators (a block instance whole, else a module path's consecutive
    operators), the parameters each is the first to read, the expert weights and each
    run's exchanged rows, the operands batch × batch products gather, the statistics
    averaged over the replicas, and the operands whose rows a loss reads alone."""

    runs: list[_Run]
    owners: list[list[str]]
    experts: frozenset[str]
    rows: list[tuple[sympy.Expr, ...]]
    gathered: dict[fx.Node, list[fx.Node]]
    statistics: set[fx.Node]
    kept: set[fx.Node]

    @classmethod
    def of(cls, gm: fx.GraphModule, numel: Mapping[str, int]) -> _Runs:
        runs: list[_Run] = []
        instance_run: dict[str, int] = {}
        for node in gm.graph.nodes:
            if node.op in _NO_WORK:
                continue
            block = BLOCK.get(node)
            if block is not None and block.instance in instance_run:
                runs[instance_run[block.instance]][2].append(node)  # keep an instance whole
                continue
            key = block.instance if block else MODULE_PATH.get(node)
            if block is None and runs and runs[-1][0] == key and runs[-1][1] is None:
                runs[-1][2].append(node)
                continue
            if block is not None:
                instance_run[key] = len(runs)
            runs.append((key, block.block_id if block else None, [node]))
        experts, rows = _experts(gm, runs)
        gathered, statistics = _replica_mixing(gm)
        kept = set((row_operands(gm) or {}).values())
        return cls(runs, _first_readers(runs, numel), experts, rows, gathered, statistics, kept)


def _segments(
    gm: fx.GraphModule, numel: Mapping[str, int], layout: TpLayout | None, analysed: _Runs
) -> tuple[Segment, ...]:
    runs, owners, experts, rows = analysed.runs, analysed.owners, analysed.experts, analysed.rows
    gathered, statistics, kept = analysed.gathered, analysed.statistics, analysed.kept
    collectives = _collectives(gm, runs, layout)
    flags = [_sharded_flags(gm, key, block_id, nodes, layout) for key, block_id, nodes in runs]
    return tuple(
        Segment(
            key,
            block_id,
            tuple(nodes),
            flags[i],
            tuple(layout is not None and n in layout.saves_replicated for n in nodes),
            sum(numel[p] for p in owners[i]),
            sum(numel[p] for p in owners[i] if _is_sharded_param(gm, nodes, p, layout)),
            len(owners[i]),
            tuple(owners[i]),
            tuple(sorted({p for n in nodes for p in PARAMS.get(n)} - set(owners[i]))),
            *collectives[i],
            _output_split(nodes, flags[i]),
            sum(numel[p] for p in owners[i] if p in experts),
            rows[i],
            sum(
                numel[p]
                for p in owners[i]
                if p in experts and _is_sharded_param(gm, nodes, p, layout)
            ),
            norm_channels=_norm_channels(nodes),
            gathered=tuple(tensor_info(a).nbytes for n in nodes for a in gathered.get(n, ())),
            gathered_rows=tuple(
                tensor_info(a).nbytes for n in nodes for a in gathered.get(n, ()) if a in kept
            ),
            statistics=tuple(tensor_info(n).nbytes for n in nodes if n in statistics),
            updates_buffers=any(map(updates_running_statistics, nodes)),
        )
        for i, (key, block_id, nodes) in enumerate(runs)
    )


def _replica_mixing(gm: fx.GraphModule) -> tuple[dict[fx.Node, list[fx.Node]], set[fx.Node]]:
    """The operands each batch × batch product gathers over the replicas where the batch
    is split, and the statistics averaged over them (`passes/batch_products.py`,
    `passes/batch_statistics.py`)."""
    products = {p: list(dict(product_operands(p))) for p in gathered_products(gm)}
    found = replica_statistics(gm)
    return products, set(found.roots) if found else set()


def _norm_channels(nodes: list[fx.Node]) -> tuple[int, ...]:
    """The channels of each batch norm among `nodes` that the batch-norm rewrite reduces
    over the replicas."""
    inputs = [n.args[0] for n in nodes if reduced_over_replicas(n)]
    return tuple(int(tensor_info(x).shape[1]) for x in inputs if isinstance(x, fx.Node))


def _experts(
    gm: fx.GraphModule, runs: list[_Run]
) -> tuple[frozenset[str], list[tuple[sympy.Expr, ...]]]:
    """The FQNs of the stacked expert weights, and per run the bytes of the rows each
    all_to_all of its expert layers moves (one into each first grouped multiply, one out
    of each last)."""
    layers = expert_layers(gm, parameter_names(gm))
    run_of = {n: i for i, (_, _, nodes) in enumerate(runs) for n in nodes}
    rows: list[list[sympy.Expr]] = [[] for _ in runs]
    for layer in layers:
        i = run_of.get(layer.offsets)
        if i is None:
            continue
        moved = [mm.args[0] for mm in layer.entries] + list(layer.exits)
        rows[i].extend(tensor_info(n).nbytes for n in moved if isinstance(n, fx.Node))
    fqns = frozenset(fqn for layer in layers for fqn in layer.params)
    return fqns, [tuple(r) for r in rows]


def _collectives(
    gm: fx.GraphModule, runs: list[_Run], layout: TpLayout | None
) -> list[tuple[tuple[TpCollective, ...] | None, tuple[fx.Node, ...]]]:
    """Per segment, its tp collectives and the operator each serves. A shared conversion
    of an activation is counted once, with the segment that produces the activation:
    the copies of a block then carry alike collectives (the first block's input, the
    embedding's partial sums, is the embedding's to reduce), so the inner stage model
    sees them as copies. The graph's outputs are gathered by the last segment."""
    if layout is None:
        return [(None, ())] * len(runs)
    segment_of = {n: i for i, (_, _, nodes) in enumerate(runs) for n in nodes}
    outputs = [n for n in gm.graph.nodes if n.op == "output"]
    found: list[dict[object, tuple[TpCollective, fx.Node]]] = [{} for _ in runs]
    for i, (_, _, nodes) in enumerate(runs):
        for node in nodes + (outputs if i == len(runs) - 1 else []):
            for k, c in enumerate(layout.collectives.get(node, ())):
                if c.source is None:
                    found[i].setdefault((node, k), (c, node))
                    continue
                owner = segment_of.get(c.source, i)
                found[owner].setdefault((c.source, c.key, c.op, c.backward), (c, node))
    return [(tuple(c for c, _ in f.values()), tuple(n for _, n in f.values())) for f in found]


def _first_readers(runs: list[_Run], numel: Mapping[str, int]) -> list[list[str]]:
    """For each run, the parameters it is the first to read. Parameters no operator
    reads still take memory: they go to the first run."""
    owners: list[list[str]] = [[] for _ in runs]
    seen: set[str] = set()
    for i, (_, _, nodes) in enumerate(runs):
        for node in nodes:
            for fqn in PARAMS.get(node):
                if fqn not in seen and fqn in numel:
                    seen.add(fqn)
                    owners[i].append(fqn)
    if owners:
        owners[0].extend(fqn for fqn in numel if fqn not in seen)
    return owners


def _sharded_flags(
    gm: fx.GraphModule,
    key: str,
    block_id: str | None,
    nodes: list[fx.Node],
    layout: TpLayout | None,
) -> tuple[bool, ...]:
    if layout is not None:
        return tuple(n in layout.split for n in nodes)
    contraction = [op_kind(op_name(n, gm)) != OTHER for n in nodes]
    if block_id is None:
        return tuple(contraction)
    sublayers = {_sublayer(key, MODULE_PATH.get(n)) for n, c in zip(nodes, contraction) if c}
    sublayers.discard(None)
    return tuple(
        c or _sublayer(key, MODULE_PATH.get(n)) in sublayers for n, c in zip(nodes, contraction)
    )


def _sublayer(instance: str, path: str) -> str | None:
    """The direct child of the block instance that `path` lies in (None: the block
    itself)."""
    rest = path[len(instance) + 1 :] if path.startswith(instance + ".") else ""
    return rest.split(".", 1)[0] or None


def _is_sharded_param(
    gm: fx.GraphModule, nodes: list[fx.Node], fqn: str, layout: TpLayout | None
) -> bool:
    if layout is not None:
        return fqn in layout.sharded_params
    for node in nodes:
        if fqn in PARAMS.get(node):
            name = op_name(node, gm)
            if name == "embedding" or op_kind(name) != OTHER:
                return True
    return False


def _traffic(seg: Segment, size: _Bytes) -> Traffic | None:
    """The segment's tp collectives, each of `size(collective, site)` bytes."""
    if seg.tp_collectives is None:
        return None
    return _alike(zip(seg.tp_collectives, seg.tp_collective_sites), size)


def _alike(collectives: Iterable[tuple[TpCollective, fx.Node | None]], size: _Bytes) -> Traffic:
    """Alike collectives counted together: (collective, bytes, in backward, bytes under
    mixed precision over the captured ones, how many)."""
    alike = Counter((c.op, size(c, site), c.backward, c.mixed_scale) for c, site in collectives)
    return tuple((*k, n) for k, n in alike.items())


def _signature(seg: Segment) -> tuple:
    """What a segment's tp traffic depends on: its collectives, whatever their sites."""
    return tuple(
        (c.op, c.nbytes, c.backward, c.activation, c.low_precision)
        for c in seg.tp_collectives or ()
    )


def _output_leaf(gm: fx.GraphModule, index: int) -> fx.Node | None:
    """The node producing the graph's output leaf `index` (as `Operands.flat` of the
    output node counts them), if it is a tensor."""
    [output] = gm.graph.find_nodes(op="output")
    leaf = flatten_args(output)[0][index]
    return leaf if isinstance(leaf, fx.Node) and isinstance(SHAPE.get(leaf), TensorInfo) else None


def _output_node(nodes: Sequence[fx.Node]) -> fx.Node | None:
    """The last tensor the segment produces: what flows to the next one."""
    return next((n for n in reversed(nodes) if isinstance(SHAPE.get(n), TensorInfo)), None)


def _output_split(nodes: Sequence[fx.Node], sharded: Sequence[bool]) -> bool:
    node = _output_node(nodes)
    return node is not None and sharded[list(nodes).index(node)]


def _output_bytes(nodes: tuple[fx.Node, ...], dims: Mapping[str, float]) -> float:
    """The bytes of the last tensor the segment produces, as captured."""
    node = _output_node(nodes)
    return evaluate(tensor_info(node).nbytes, dims) if node is not None else 0.0


def _static_batch(gm: fx.GraphModule) -> int | None:
    """The batch a graph was captured with, if it is static (dim 0 of the first tensor
    input is a number); None when the batch is the dynamic dim `batch`."""
    for node in gm.graph.nodes:
        info = SHAPE.get(node) if node.op == "placeholder" else None
        if isinstance(info, TensorInfo) and info.shape:
            first = sympy.sympify(info.shape[0])
            return int(first) if first.is_Integer else None
    return None
