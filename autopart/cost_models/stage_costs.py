"""The costs the inner solver weighs when it cuts pipeline stages and picks the blocks to
recompute, for one outer candidate (degrees, ZeRO stage, schedule, microbatches).

The graph's segments become `Unit`s in order, each with its time per microbatch
(forward, backward and its tensor-parallel collectives, as `predict` charges them), its
parameters, the bytes it saves for backward, and, for a block that may be recomputed,
what recomputing it adds (time) and frees (its saved bytes, less its input, which it
keeps), and what recomputing its attention core alone adds and frees (selective
recomputation, `passes.attention_core`). All figures are integers, so the CP-SAT model
and a brute-force enumeration weigh exactly the same numbers, in units sized to the
problem (`TIME_STEPS`, `MEMORY_STEPS`): an LP with coefficients near 1e11 (bytes of an
80 GB device times the allocator's and the schedule's fractions) stalls CP-SAT's linear
relaxation.
Memory figures are rounded up and the device's memory down, so what fits in units
fits in bytes.

Per pipeline rank r, holding chunks r, r + p, ... (interleaved), the memory is
`predict`'s, as a sum the solver can keep linear:

    (1 + allocator) · [ states_r + in_flight_r · (kept_r + Σ recomputed inputs)
                        + largest recomputed block or core + buffers_r + fixed_r ]

where states_r is the bytes of the rank's parameters, gradients and optimizer state
under the ZeRO stage, buffers_r the ZeRO reduce-scatter bucket (at most the rank's
gradients), and fixed_r the ZeRO-3 gathered blocks, the pipeline's send and receive
buffers and, on the rank running the last chunk, the loss's output gradients. A rank's
pace is its time per microbatch; the pipeline runs at its slowest rank's
(`pipeline.pipeline_step`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from fractions import Fraction

from autopart.cost_models.batch_mixing import segment_mixing_sync
from autopart.cost_models.batch_norm import segment_norm_sync
from autopart.cost_models.choices import Choices, CostModels
from autopart.cost_models.context import conversion_comm, ring_comm
from autopart.cost_models.experts import segment_all_to_all
from autopart.cost_models.memory import (
    OUTPUT_GRADIENTS,
    in_flight_microbatches,
    sharded_state_bytes,
)
from autopart.cost_models.predict import (
    attention_recompute_cost,
    p2p_comm,
    rank_segments,
    segment_times,
    tp_comm,
    zero3_gathered,
)
from autopart.cost_models.summary import BATCH, GraphSummary, SegmentWork
from autopart.degrees import Axis

# The device's memory is counted in about MEMORY_STEPS units, a microbatch's time on
# the slowest-possible rank (all of it) in about TIME_STEPS: fine enough that rounding
# moves no real decision, coarse enough for CP-SAT's linear relaxation.
MEMORY_STEPS = 1 << 20
TIME_STEPS = 1 << 24


@dataclass(frozen=True, slots=True)
class Unit:
    """One segment of the graph as the inner solver sees it (time and memory in the
    problem's units). Units are equal where their figures are, whatever their keys:
    copies of one block."""

    key: str = field(compare=False)
    kind: str | None  # the block's structure (`BlockInfo.block_id`); None: not recomputable
    time: int  # per microbatch, not recomputed
    states: int  # its parameters, gradients and optimizer state on this rank
    saved: int  # saved for backward per microbatch, not recomputed
    recompute_time: int = 0  # added when recomputed
    recompute_keeps: int = 0  # what a recomputed block keeps per microbatch (its input)
    grads: int = 0  # its gradients (what ZeRO's reduce-scatter bucket holds at most)
    attention_time: int = 0  # added when its attention core alone is recomputed
    attention_frees: int = 0  # what that frees per microbatch

    @property
    def has_attention_core(self) -> bool:
        return self.kind is not None and self.attention_frees > 0


@dataclass(frozen=True, slots=True)
class StageProblem:
    """Cut `units` into `chunks` contiguous chunks (chunk c on rank c mod `pp`) at
    `cut_positions` (unit indices where a chunk may begin), and choose the recomputed
    blocks, so that every rank fits `memory` bytes."""

    units: tuple[Unit, ...]
    pp: int
    chunks: int
    cut_positions: tuple[int, ...]
    in_flight: tuple[Fraction, ...]  # per rank, in units of its whole share
    bucket: int  # ZeRO's reduce-scatter bucket cap; 0 when there is none
    fixed: tuple[int, ...]  # per rank: memory that depends on no choice
    comm: tuple[int, ...]  # per rank: time per microbatch that depends on no choice
    allocator: Fraction
    memory: int
    time_unit_s: float = 1.0  # the seconds one unit of time stands for

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(u.kind for u in self.units if u.kind is not None))

    def rank_of(self, chunk: int) -> int:
        return chunk % self.pp


@dataclass(frozen=True, slots=True)
class StageAssignment:
    """Where chunks 1 .. K−1 begin (unit indices), the recomputed units (whole, and
    attention core alone), and what that costs: the slowest rank's time per microbatch,
    the recomputation's time summed over ranks, and every rank's memory."""

    starts: tuple[int, ...]
    recomputed: frozenset[int]
    pace: int
    added: int
    peaks: tuple[int, ...]
    attention: frozenset[int] = frozenset()

    def fits(self, memory: int) -> bool:
        return max(self.peaks) <= memory


def evaluate(
    problem: StageProblem,
    starts: Sequence[int],
    recomputed: frozenset[int],
    attention: frozenset[int] = frozenset(),
) -> StageAssignment:
    """The pace, added recomputation and per-rank memory of one assignment: the units in
    `recomputed` are recomputed whole, the others in `attention` their core alone."""
    bounds = [0, *starts, len(problem.units)]
    times = [0] * problem.pp
    added = 0
    states = [0] * problem.pp
    grads = [0] * problem.pp
    kept = [0] * problem.pp
    largest = [0] * problem.pp
    for chunk in range(problem.chunks):
        r = problem.rank_of(chunk)
        for i in range(bounds[chunk], bounds[chunk + 1]):
            u = problem.units[i]
            states[r] += u.states
            grads[r] += u.grads
            if i in recomputed:
                times[r] += u.time + u.recompute_time
                added += u.recompute_time
                kept[r] += u.recompute_keeps
                largest[r] = max(largest[r], u.saved)
            elif i in attention:
                times[r] += u.time + u.attention_time
                added += u.attention_time
                kept[r] += u.saved - u.attention_frees
                largest[r] = max(largest[r], u.attention_frees)
            else:
                times[r] += u.time
                kept[r] += u.saved
    peaks = tuple(
        _memory(problem, r, states[r], grads[r], kept[r], largest[r]) for r in range(problem.pp)
    )
    pace = max(t + c for t, c in zip(times, problem.comm))
    return StageAssignment(tuple(starts), recomputed, pace, added, peaks, attention - recomputed)


def _cp_comm(seg: SegmentWork, choices: Choices, models: CostModels, recomputed: bool) -> float:
    """A segment's context-parallel communication per microbatch, as `predict` charges
    it: its rings and its conversions (the gradients' all-reduces and the logits'
    gather are the rank's, not the segment's)."""
    if choices.cp == 1:
        return 0.0
    cp, tp, precision, comm = choices.cp, choices.tp, choices.precision, models.comm
    again = [recomputed]
    rings = ring_comm([seg], cp, tp, precision, again, comm, models.compute)
    return rings + conversion_comm([seg], cp, tp, precision, again, comm)


def _most_gathered(blocks: Sequence[SegmentWork], choices: Choices) -> float:
    """The most parameters ZeRO-3 gathers whole for one block (`zero3_gathered`), over
    one copy of each block: copies hold alike parameters."""
    one_each = {s.segment.block_id: s for s in blocks}.values()
    return max((zero3_gathered(s, choices) for s in one_each), default=0.0)


# What a plan's units depend on, of its choices: all but how its pipeline runs them.
_UNIT_CHOICES = tuple(
    f.name for f in fields(Choices) if f.name not in ("schedule", "virtual_stages", "stage_cuts")
)


def _units(
    segments: Sequence[SegmentWork],
    choices: Choices,
    models: CostModels,
    byte: float,
    recomputable: bool,
) -> tuple[tuple[Unit, ...], float]:
    """The problem's units and the seconds a unit of time stands for, worked out once
    for the plans that differ only in their schedule, virtual stages or cuts (the
    search fits many of them): `_made_units`."""
    key = (
        "units",
        id(segments),
        byte,
        recomputable,
        *(getattr(choices, name) for name in _UNIT_CHOICES),
    )
    made = models.remember(
        key, lambda: (segments, *_made_units(segments, choices, models, byte, recomputable))
    )
    return made[1], made[2]


def _made_units(
    segments: Sequence[SegmentWork],
    choices: Choices,
    models: CostModels,
    byte: float,
    recomputable: bool,
) -> tuple[tuple[Unit, ...], float]:
    """Each segment as a `Unit`, in units of `byte` bytes and of the time returned."""
    plain = segment_times(segments, models.compute, [False] * len(segments))
    again = segment_times(segments, models.compute, [s.is_block for s in segments])

    def states(seg: SegmentWork) -> float:
        params = seg.param_numel(choices.tp, choices.ep)
        experts = seg.expert_numel(choices.ep, choices.tp)
        per_param = choices.state_bytes
        parts = sharded_state_bytes(
            params, experts, choices.dp, choices.ep, choices.zero, per_param, choices.offload
        )
        return sum(parts.values())

    grad_bytes = choices.state_bytes[1]
    tick = max(t.total for t in again) * len(segments) / TIME_STEPS  # seconds a unit

    def up(nbytes: float) -> int:
        return math.ceil(nbytes / byte)

    units = []
    alike: dict[tuple, Unit] = {}  # copies of one block are one unit but for their key
    for seg, t0, t1 in zip(segments, plain, again):
        fixed = choices.recomputes(seg)
        same = (seg.segment.block_id, fixed, choices.recomputes_attention(seg))
        if seg.is_block and same in alike:
            units.append(replace(alike[same], key=seg.key))
            continue
        comm0 = tp_comm(seg, choices, models.comm, recomputed=False)
        comm1 = tp_comm(seg, choices, models.comm, recomputed=True)
        comm0 += segment_all_to_all(seg, choices, models.comm, recomputed=False)
        comm1 += segment_all_to_all(seg, choices, models.comm, recomputed=True)
        comm0 += segment_norm_sync(seg, choices, models.comm, recomputed=False)
        comm1 += segment_norm_sync(seg, choices, models.comm, recomputed=True)
        comm0 += segment_mixing_sync(seg, choices, models.comm, recomputed=False)
        comm1 += segment_mixing_sync(seg, choices, models.comm, recomputed=True)
        comm0 += _cp_comm(seg, choices, models, recomputed=False)
        comm1 += _cp_comm(seg, choices, models, recomputed=True)
        saved = seg.saved_bytes(choices.precision, choices.compiled)
        core = attention_recompute_cost(seg, models.compute).total if seg.is_block else 0.0
        frees = seg.core_frees_bytes(choices.precision) if seg.is_block else 0.0
        if fixed:
            base, keeps = t1.total + comm1, seg.output_bytes
        elif choices.recomputes_attention(seg):  # pinned: its core alone, always
            base, keeps = t0.total + comm0 + core, saved - frees
        else:
            base, keeps = t0.total + comm0, saved
        may = recomputable and seg.is_block and not fixed and not seg.segment.updates_buffers
        params = seg.param_numel(choices.tp, choices.ep)
        units.append(
            Unit(
                key=seg.key,
                kind=seg.segment.block_id if may else None,
                time=round(base / tick),
                states=up(states(seg)),
                saved=up(saved if may else keeps),
                recompute_time=round((t1.total + comm1 - base) / tick) if may else 0,
                recompute_keeps=up(seg.output_bytes) if may else 0,
                grads=up(params * grad_bytes),
                attention_time=round(core / tick) if may else 0,
                # Rounded down, as what it frees is subtracted from what is kept.
                attention_frees=math.floor(frees / byte) if may else 0,
            )
        )
        if seg.is_block:
            alike[same] = units[-1]
    return tuple(units), tick


def _in_flight(choices: Choices, models: CostModels) -> tuple[Fraction, ...]:
    """Per rank, the microbatches in flight (`in_flight_microbatches`), as fractions:
    alike for every plan of one pipeline shape."""
    schedule, m, pp, v = choices.schedule, choices.microbatches, choices.pp, choices.virtual_stages

    def made() -> tuple[Fraction, ...]:
        return tuple(
            Fraction(in_flight_microbatches(schedule, m, pp, r, v)).limit_denominator(64)
            for r in range(pp)
        )

    return models.remember(("in flight", schedule, m, pp, v), made)


def _rank_sends(
    boundary: float, choices: Choices, models: CostModels, tick: float
) -> tuple[int, ...]:
    """Per rank, its sends in units of `tick` (`predict.p2p_comm`): alike for every plan
    of one pipeline shape that sends alike."""
    pp, chunks, stride = choices.pp, choices.chunks, choices.degrees.stride(Axis.PP)

    def made() -> tuple[int, ...]:
        return tuple(round(p2p_comm(boundary, choices, models, r) / tick) for r in range(pp))

    return models.remember(("rank sends", boundary, pp, chunks, stride, tick), made)


def _memory(
    problem: StageProblem, rank: int, states: int, grads: int, kept: int, largest: int
) -> int:
    bucket = min(problem.bucket, grads)
    body = states + problem.in_flight[rank] * kept + largest + bucket + problem.fixed[rank]
    return math.ceil((1 + problem.allocator) * body)  # fits iff the exact amount fits


def stage_problem_of(
    summary: GraphSummary,
    choices: Choices,
    dims: Mapping[str, int],
    models: CostModels,
    memory: int,
    recomputable: bool,
) -> StageProblem:
    """`stage_problem` of a graph's summary at the plan's microbatch size (`dims`: the
    other named dims), on one rank's share of it (`predict.rank_segments`)."""
    segments = rank_segments(summary, {**dims, BATCH: choices.microbatch_size}, choices)
    return stage_problem(segments, choices, models, memory, recomputable)


def stage_problem(
    segments: Sequence[SegmentWork],
    choices: Choices,
    models: CostModels,
    memory: int,
    recomputable: bool,
) -> StageProblem:
    """The inner problem of `choices` (whose `recompute` blocks are taken as recomputed
    whatever the solver decides) over `segments`, sharded at the microbatch's size.
    With `recomputable`, every other block may be recomputed."""
    param_bytes = choices.state_bytes[0]
    byte = max(1.0, memory / MEMORY_STEPS)
    units, tick = _units(segments, choices, models, byte, recomputable)

    def up(nbytes: float) -> int:
        return math.ceil(nbytes / byte)

    chunks, pp = choices.chunks, choices.pp
    blocks = [s for s in segments if s.is_block]
    boundary = max((s.output_bytes for s in blocks), default=0.0)
    zero3 = 2 * _most_gathered(blocks, choices) * param_bytes if choices.zero == 3 else 0.0
    pipeline = 2 * boundary if pp > 1 else 0.0
    loss = OUTPUT_GRADIENTS * segments[-1].output_bytes * choices.cp  # gathered over cp
    last_rank = (chunks - 1) % pp
    starts = [i for i, s in enumerate(segments) if s.is_block][1:]
    return StageProblem(
        units=units,
        pp=pp,
        chunks=chunks,
        cut_positions=tuple(starts),
        in_flight=_in_flight(choices, models),
        bucket=up(models.memory.bucket_bytes)
        if choices.degrees.batch_split > 1 and choices.zero
        else 0,
        fixed=tuple(up(zero3 + pipeline + (loss if r == last_rank else 0.0)) for r in range(pp)),
        comm=_rank_sends(boundary, choices, models, tick),
        allocator=Fraction(models.memory.allocator_fraction).limit_denominator(1000),
        memory=math.floor(memory / byte),
        time_unit_s=tick,
    )
