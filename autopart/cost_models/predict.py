"""What a plan will cost: step time with its parts, peak memory with its parts, model
FLOP/s per device, from an analyzed graph, a mesh and the plan's choices.

Per microbatch of global_batch / (dp · m) rows, every segment of the graph is priced by
the compute model (forward, backward, recomputation) on this rank's tensor-parallel
share. Segments go to pipeline chunks (the plan's stage cuts, or an even split by
blocks) and chunks to pipeline ranks; then per rank:

  communication on the critical path, per microbatch:
    tensor parallelism: the collectives the plan's layout inserts in each segment
      (`tp_costs.collectives_of`: row-parallel reductions, conversions between layouts,
      their gradients), forward ones again when recomputed, over the tp axis (stride 1).
      Without a layout (a summary made without one), the Megatron-LM count: each block
      all-reduces its output twice in forward and twice in backward;
    pipeline transfers: one activation sent forward and one gradient sent backward per
      chunk, over the pp axis (stride dp·tp);
    ZeRO-3: every microbatch gathers the rank's parameters bucket by bucket (a block, or
      a run of segments between blocks) in forward and again in backward, and
      reduce-scatters each bucket's gradients; the gathers hide behind forward and
      backward compute, each pass's first gather and the last bucket's reduce-scatter
      do not (on a CPU, a bucket costs what the profile measured its three add); a
      recomputed block's backward gather serves its recomputation, which adds no
      gather, only compute to hide them behind;
    batch norms over the global batch: one all-reduce of per-channel sums per norm in
      forward and one in backward, over dp × ep (`batch_norm.py`); a batch × batch
      product's operands all-gathered forward and reduce-scattered backward, a
      statistic combined over the batch all-reduced both ways (`batch_mixing.py`);
  gradient synchronization over dp (stride tp), once per step after the last
    microbatch: bucketed all-reduce (ZeRO-0) or reduce-scatter (ZeRO-1/2), hidden behind
    the last microbatch's backward but for its last bucket (`pipeline.exposed_sync`);
    ZeRO-1/2 then all-gather the updated parameters, fully exposed;
  the optimizer step (`ComputeModel.optimizer_step_time`);
  on a running Gloo mesh nothing hides behind compute (`CommModel.overlaps_compute`);
  the step's sums (`runtime/step_sums.py`: the loss averaged over the data-parallel
    replicas as `ParallelModule.train_step` returns it, the gradient norm's parts, the
    inputs' checksums), one all-reduce of a few values over the whole world, exposed,
    with the optimizer step (`_step_sums_time`).

The tensor-parallel layout is the plan's (`Choices.tp_placements`): the operators the
rewrite shards run on 1/tp of the work, the rest in full on every tp rank (`summary.py`).

The pipeline formula (`pipeline.pipeline_step`) turns per-microbatch times into the
step; the largest rank's memory is the plan's peak. Model FLOP/s count forward and
backward (3× forward FLOPs) without recomputation, as in MFU (Chowdhery et al., PaLM).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from torch import fx

from autopart.cost_models.batch_mixing import mixing_sync_comm
from autopart.cost_models.batch_norm import norm_sync_comm
from autopart.cost_models.choices import Choices, CostModels
from autopart.cost_models.comm import (
    ALL_GATHER,
    ALL_REDUCE,
    REDUCE_SCATTER,
    CommModel,
)
from autopart.cost_models.compression import gradient_fraction
from autopart.cost_models.compute import ComputeModel, PhaseCost
from autopart.cost_models.context import (
    conversion_comm,
    gradient_all_reduces,
    output_gather,
    ring_comm,
    ring_floor,
)
from autopart.cost_models.experts import all_to_all_comm
from autopart.cost_models.fusion import regions_per_call
from autopart.cost_models.memory import (
    FP32_WEIGHTS,
    OUTPUT_GRADIENTS,
    Activations,
    in_flight_microbatches,
    total,
)
from autopart.cost_models.offload import host_step_time
from autopart.cost_models.pipeline import (
    bucket_runs,
    exposed_sync,
    pipeline_step,
    span_floor,
)
from autopart.cost_models.precision import is_mixed
from autopart.cost_models.stages import balanced_chunks, chunks_at_cuts
from autopart.cost_models.summary import BATCH, GraphSummary, SegmentWork
from autopart.degrees import Axis
from autopart.mesh import Mesh
from autopart.plan import Predicted, StageFigures
from autopart.policy import ZERO3_BUCKET_BYTES, ZERO3_REGATHER_AFTER, Schedule

# The step's sums (runtime/step_sums.py): the loss, the squared gradient norm and the
# inputs' checksums, a few float64 values.
STEP_SUMS_BYTES = 64.0
TP_ALL_REDUCES_FORWARD = 2  # per block: after attention, after the MLP
TP_ALL_REDUCES_BACKWARD = 2
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RankCost:
    """One pipeline rank: per-microbatch compute and critical-path communication, the
    once-per-step parts, and its memory."""

    compute: PhaseCost
    comm: float
    sync: float
    optimizer: float
    memory: dict[str, int]
    figures: StageFigures


def predict(
    graph: fx.GraphModule | GraphSummary,
    mesh: Mesh,
    choices: Choices,
    dims: Mapping[str, int] | None = None,
    models: CostModels | None = None,
) -> Predicted:
    """The plan's step time (compute, exposed communication, bubble), the largest rank's
    memory by part, and model FLOP/s per device. `graph` is an analyzed graph (or its
    summary, to price many plans of one graph: it keeps the tensor-parallel layout it
    was made with); `dims` gives the sizes of named dims other than the batch
    (`{"seq": 2048}` when the sequence is dynamic)."""
    summary = (
        graph if isinstance(graph, GraphSummary) else GraphSummary(graph, choices.tp_layout(graph))
    )
    mesh.check_covered(choices.degrees)
    models = models or CostModels.of(mesh, choices.precision, choices.compiled)
    at = {**(dims or {}), BATCH: choices.microbatch_size}
    full = summary.evaluate(at)
    segments = rank_segments(summary, at, choices)
    times = _segment_times(segments, choices, models)
    chunk_of = (
        chunks_at_cuts(segments, choices.stage_cuts)
        if choices.stage_cuts
        else balanced_chunks(segments, [t.total for t in times], choices.chunks)
    )
    pp = choices.pp
    of_rank = _rank_spans(chunk_of, pp)
    traffic = (
        gradient_fraction(
            choices.grad_compression,
            [p.shape for p in summary.gm.parameters()],
            choices.state_bytes[1],
        )
        if choices.grad_compression
        else 1.0  # the search prices thousands of plans: no pass over the parameters
    )
    shared: dict = {}
    ranks = [
        _rank_cost(r, of_rank[r], segments, times, choices, models, traffic, shared)
        for r in range(choices.pp)
    ]
    step = pipeline_step(
        [r.compute.total for r in ranks],
        [r.comm for r in ranks],
        choices.microbatches,
        choices.schedule,
        choices.virtual_stages,
        [r.compute.forward / r.compute.total if r.compute.total else 0.0 for r in ranks],
    )
    optimizer = max(r.optimizer for r in ranks)
    sync = max(r.sync for r in ranks)
    step_time = step.total + optimizer + sync
    peak = max(ranks, key=lambda r: total(r.memory)).memory
    model_flops = (
        3 * sum(s.flops for s in full) * choices.microbatches * choices.degrees.batch_split
    )
    return Predicted(
        step_time_s=step_time,
        compute_s=step.compute + optimizer,
        exposed_comm_s=step.exposed_comm + sync,
        bubble_s=step.bubble,
        peak_memory_bytes=total(peak),
        memory=peak,
        model_flops_per_device=model_flops / mesh.world_size / step_time,
        stages=tuple(r.figures for r in ranks),
        compiled=choices.compiled,
    )


def step_time_lower_bound(
    summary: GraphSummary,
    choices: Choices,
    dims: Mapping[str, int],
    models: CostModels,
    cache: dict | None = None,
    cp_layout: bool = True,
    last_rank: bool = False,
) -> float:
    """A floor under `predict(...).step_time_s`, whatever the stage cuts: the pipeline
    ranks' summed work for a microbatch (the compute, the tensor-parallel collectives,
    context parallelism's rings, conversions and logits' gather, the stage transfers,
    each no smaller than the smallest block's output, and ZeRO-3's collectives at
    their least, `_zero3_floor`) in the least span any split of it among the ranks
    allows (`pipeline.span_floor`), with no other communication or optimizer step;
    under context parallelism without the sync's sums, the gradient all-reduces over cp
    that every microbatch leaves exposed. Without `cp_layout`, every operator is
    counted on 1/cp of the microbatch, even those the cp rewrite runs whole, and each
    attention adds the lesser of its ring and its whole sequence's compute
    (`context.ring_floor`): a lower floor that needs no cp layout, which is dear to
    make; it leaves ZeRO-3 out, as that compute, counted apart, could hide its
    collectives.
    With `last_rank`, a GPipe or 1F1B pipeline cut where blocks begin (as `predict`
    cuts one without stage cuts) spans at least that work and m − 1 more microbatches
    of its last rank (`span_floor`'s bound for it), which holds a block at least, the
    segments after the last block, its own sends and ZeRO-3's unhidden collectives
    (`_zero3_least`): deeper than a few ranks, the geometric split `span_floor`
    assumes leaves the last rank less than a block. The step's own work then follows
    (`once_per_step_floor`).
    The search does not price a plan whose floor is slower than a plan it has. `cache`:
    a dict kept across calls on one graph and mesh, for a microbatch's work (the search
    asks for thousands of plans)."""
    cp = choices.cp
    # A microbatch's work, alike for plans that differ only in whether the sync sums
    # cp's parts (ZeRO-0 or not): worked out once for them, cp's all-reduces apart.
    shared = (
        id(summary),
        choices.tp,
        cp,
        cp > 1 and cp_layout,
        choices.microbatch_size,
        choices.recompute,
        choices.recompute_attention,
        choices.precision,
        choices.sequence_parallel,
    )
    key = (*shared, cp > 1 and choices.cp_in_sync)
    kept = cache.get(key) if cache is not None else None

    def rank_work() -> tuple[Sequence[SegmentWork], Sequence[PhaseCost]]:
        at = {**dims, BATCH: choices.microbatch_size}
        segments = (
            rank_segments(summary, at, choices)
            if cp_layout
            else summary.sharded({**at, BATCH: at[BATCH] / cp}, choices.tp)
        )
        return segments, _segment_times(segments, choices, models)

    if kept is None:
        made = cache.get(("work", shared)) if cache is not None else None
        if made is None:
            made = _microbatch_work(*rank_work(), summary, choices, dims, models, cp_layout)
            if cache is not None:
                cache["work", shared] = made
        work, boundary, blocks, forward, later, params = made
        if cp > 1 and not choices.cp_in_sync:
            grad_bytes = choices.state_bytes[1]
            comm = models.comm
            work += gradient_all_reduces(params, choices.cp, choices.tp, grad_bytes, comm)
        kept = (work, boundary, blocks, forward, later, params)
        if cache is not None:
            cache[key] = kept
    work, boundary, blocks, forward, later, params = kept
    if cp == 1 or cp_layout:
        work += _zero3_floor(forward, later, params, choices, models)
    if blocks < choices.chunks or choices.stage_cuts:
        boundary = 0.0  # a chunk may hold no block (cut anywhere, or as pinned): it sends nothing
    pp = choices.pp
    work += pipeline_sends(boundary, choices, models)
    floor = work * span_floor(choices.schedule, pp, choices.microbatches, choices.virtual_stages)
    cut_at_blocks = blocks >= choices.chunks and not choices.stage_cuts
    if last_rank and cut_at_blocks and pp > 1 and choices.schedule in _SPANNED:
        # Rank p − 1 starts after the others' first forwards, runs its m microbatches,
        # then the others run the last backward: its constraint of `span_floor`.
        ends = cache.get(("last", key)) if cache is not None else None
        if ends is None:
            segments, times = rank_work()
            tail = _last_chunk_floor(segments, times, choices, models.comm)
            ends = (tail, _least_first_bucket(segments, choices.tp, models))
            if cache is not None:
                cache["last", key] = ends
        tail, least = ends
        last = tail + p2p_comm(boundary, choices, models, pp - 1)
        last += _zero3_least(least, choices, models)
        floor = max(floor, work + (choices.microbatches - 1) * last)
        if choices.ep == 1:
            floor += once_per_step_floor(params, choices, models)
    return floor


def _microbatch_work(
    segments: Sequence[SegmentWork],
    times: Sequence[PhaseCost],
    summary: GraphSummary,
    choices: Choices,
    dims: Mapping[str, int],
    models: CostModels,
    cp_layout: bool,
) -> tuple[float, float, int, float, float, float]:
    """`step_time_lower_bound`'s figures of a microbatch on the ranks together, but for
    cp's gradient all-reduces: its work (compute, tensor-parallel collectives, context
    parallelism's rings, conversions and logits' gather), the smallest block's output,
    the blocks, the compute in forward and after it, and the parameters one rank of
    tp holds over all stages."""
    work: float = sum(t.total for t in times)
    work += _tp_comm(segments, choices, models.comm)
    cp = choices.cp
    if cp > 1:  # the rings, conversions and logits' gather it makes
        again = [choices.recomputes(s) for s in segments]
        tp, precision = choices.tp, choices.precision
        comm, compute = models.comm, models.compute
        if cp_layout:
            work += ring_comm(segments, cp, tp, precision, again, comm, compute)
            work += conversion_comm(segments, cp, tp, precision, again, comm)
        else:  # each attention's ring, or its whole sequence
            whole = summary.sharded({**dims, BATCH: choices.microbatch_size}, tp)
            work += ring_floor(segments, whole, cp, tp, precision, again, comm, compute)
        work += output_gather(segments[-1].output_bytes, cp, tp, comm)
    # All stages' parameters: spread over pp below, which only lowers the floor.
    params = sum(s.param_numel(choices.tp) for s in segments)
    outputs = [s.output_bytes for s in segments if s.is_block]
    forward = sum(t.forward for t in times)
    later = sum(t.backward + t.recompute for t in times)
    return work, min(outputs, default=0.0), len(outputs), forward, later, params


def balanced_pipeline_floors(
    summary: GraphSummary, choices: Choices, dims: Mapping[str, int], models: CostModels
) -> tuple[float, int]:
    """Floors under `predict`'s step time and peak memory of a GPipe, 1F1B or
    interleaved 1F1B pipeline that recomputes nothing and has no stage cuts, cut as
    `predict` cuts it (`balanced_chunks`); (0, 0) for any other plan. Rank r's
    microbatch takes at least t_r, its segments' compute and tensor-parallel
    collectives, its sends and ZeRO-3's unhidden collectives (`_zero3_least`). GPipe
    and 1F1B span at least m · t_k + Σ_{i<k} t_i for every rank k (`span_floor`);
    interleaved 1F1B is priced m · t_s + Σ_{r≠s} t_r / v at its slowest rank s
    (`pipeline_step`), which grows with every rank's time, so it spans at least that
    of the t_r. Then the step's own work (`once_per_step_floor`).
    The first rank holds at least its states and its microbatches in flight, with the
    allocator's share: `MemoryModel.breakdown` without its buffers and output."""
    pp, m = choices.pp, choices.microbatches
    plain = not choices.recompute and not choices.recompute_attention
    if pp == 1 or choices.stage_cuts or choices.schedule not in _BALANCED or not plain:
        return 0.0, 0
    segments = rank_segments(summary, {**dims, BATCH: choices.microbatch_size}, choices)
    columns = _Columns.of(segments, choices, models)
    if sum(columns.is_block) < choices.chunks:
        return 0.0, 0
    busy, spans, least = _balanced_ranks(segments, columns, choices, models)
    unhidden = _zero3_least(least, choices, models) if choices.ep == 1 else 0.0
    ranks = [t + unhidden for t in busy]
    if choices.schedule == Schedule.INTERLEAVED_1F1B:
        slowest = max(ranks)
        span = m * slowest + (sum(ranks) - slowest) / choices.virtual_stages
    else:
        span = max(m * t + before for t, before in zip(ranks, itertools.accumulate([0.0, *ranks])))
    params = sum(columns.params)
    if choices.ep == 1:
        span += once_per_step_floor(params, choices, models)
    first = spans[0]
    in_flight = in_flight_microbatches(choices.schedule, m, pp, 0, choices.virtual_stages)
    memory = models.memory.breakdown(
        sum(_in_spans(columns.params, first)),
        choices.dp,
        choices.zero,
        activations=in_flight * sum(_in_spans(columns.saved, first)),
        offload=choices.offload,
        experts=sum(_in_spans(columns.experts, first)),
        ep=choices.ep,
        master_weights=choices.master_weights,
    )
    return span * (1 - 1e-9), total(memory)  # less a margin for the sums' order


def _balanced_ranks(
    segments: tuple[SegmentWork, ...], columns: _Columns, choices: Choices, models: CostModels
) -> tuple[list[float], list[tuple[tuple[int, int], ...]], float]:
    """`balanced_pipeline_floors`'s ranks, worked out once for the plans that cut
    `segments` alike (they differ in the ZeRO stage, or in dp and microbatches by the
    same factor): per rank, its segments' compute and tensor-parallel collectives and
    its sends; its spans; and the fewest parameters its first ZeRO-3 bucket holds."""
    key = (
        "balanced",
        id(segments),
        choices.chunks,
        choices.pp,
        choices.degrees.stride(Axis.PP),
        choices.tp,
        choices.ep,
        choices.precision,
        choices.compiled,
    )

    def made() -> tuple[tuple[SegmentWork, ...], list[float], list, float]:
        times = _segment_times(segments, choices, models)
        chunk_of = balanced_chunks(segments, [t.total for t in times], choices.chunks)
        spans = _rank_spans(chunk_of, choices.pp)
        ranks = []
        for r, own in enumerate(spans):
            busy = sum(t.total for t in _in_spans(times, own)) + sum(_in_spans(columns.tp, own))
            boundary = max(_in_spans(columns.block_outputs, own), default=0.0)
            ranks.append(busy + p2p_comm(boundary, choices, models, r))
        least = _least_first_bucket(segments, choices.tp, models) if choices.ep == 1 else 0.0
        return segments, ranks, spans, least

    _, ranks, spans, least = models.remember(key, made)
    return ranks, spans, least


# The schedules `pipeline.schedule_span` simulates rank by rank.
_SPANNED = (Schedule.GPIPE, Schedule.ONE_F_ONE_B)
# Those `balanced_pipeline_floors` floors.
_BALANCED = (*_SPANNED, Schedule.INTERLEAVED_1F1B)


def _last_chunk_floor(
    segments: Sequence[SegmentWork], times: Sequence[PhaseCost], choices: Choices, comm: CommModel
) -> float:
    """The least the last chunk of a pipeline cut where blocks begin computes and
    spends on tensor-parallel collectives for a microbatch: the cheapest block and
    every segment after the last block (the head and the loss), which it holds."""
    ends = [i for i, s in enumerate(segments) if s.is_block]
    if not ends:
        return 0.0
    each = [
        t.total + tp_comm(s, choices, comm, choices.recomputes(s)) for s, t in zip(segments, times)
    ]
    return min(each[i] for i in ends) + sum(each[ends[-1] + 1 :])


def unhidden_gathers(
    segments: Sequence[SegmentWork], choices: Choices, models: CostModels
) -> list[float] | None:
    """Per segment of the plan's list (`rank_segments`), seconds that ZeRO-3's gathers
    add at least to a pipeline rank's microbatch beyond its compute, whatever the stage
    cuts and recomputation: a rank's forward gathers its parameters bucket by bucket,
    behind its forward compute at most (`_zero3_comm`), so its forward takes at least
    the sum over its segments of their parameters' gathers (`_least_gathers`) less
    their forward (recomputation adds only to backward). None where the collectives are
    priced otherwise (experts, measured buckets, compiled regions) or where a block's
    gathers hide behind its forward."""
    comm, dp = models.comm, choices.dp
    if choices.zero != 3 or choices.ep > 1 or dp == 1 or choices.compiled:
        return None
    if comm.measures_zero3_buckets:
        return None
    times = _segment_times(segments, choices, models)
    gathers = _least_gathers(segments, choices, comm)
    extra = [g - t.forward for g, t in zip(gathers, times)]
    if min(e for e, s in zip(extra, segments) if s.is_block) <= 0:
        return None
    return extra


def _least_gathers(
    segments: Sequence[SegmentWork], choices: Choices, comm: CommModel
) -> list[float]:
    """Per segment, the least seconds ZeRO-3's forward spends gathering its parameters,
    whatever the stage cuts. A block's parameters fill buckets of their own
    (`_buckets_of`: a block begins a bucket, and the segment after it another), so its
    gathers take what `_zero3_comm` charges them; another segment's may share a bucket
    with its neighbours', so they take at least the collective's least seconds per
    byte (`_per_byte`: a collective's time is at least that times its bytes)."""
    group, param_bytes = (choices.dp, choices.degrees.stride(Axis.DP)), choices.state_bytes[0]
    per_byte = _per_byte(lambda b: comm.time(ALL_GATHER, b, *group))
    blocks: dict[str | None, float] = {}  # copies of one block gather alike
    out = []
    for seg in segments:
        if not seg.is_block:
            out.append(seg.param_numel(choices.tp) * param_bytes * per_byte)
            continue
        if seg.segment.block_id not in blocks:
            buckets, _ = _buckets_of([seg], lambda s: s.param_numel(choices.tp))
            gathers = (comm.time(ALL_GATHER, b * param_bytes, *group) for b in buckets)
            blocks[seg.segment.block_id] = sum(gathers)
        out.append(blocks[seg.segment.block_id])
    return out


def _least_first_bucket(segments: Sequence[SegmentWork], tp: int, models: CostModels) -> float:
    """The fewest parameters a pipeline rank's first ZeRO-3 bucket can hold, the chunks
    beginning at blocks: a block's first bucket, or on the first rank the first
    segment's holding parameters, each capped at the pass's bucket; 0 where a block
    holds none (a rank could then gather nothing). Worked out once per segments."""

    def made() -> tuple[Sequence[SegmentWork], float]:
        held = [s.param_numel(tp) for s in segments]
        firsts = [p for s, p in zip(segments, held) if s.is_block]
        firsts += [p for p in held if p > 0][:1]
        return segments, min(min(firsts), ZERO3_BUCKET_BYTES / FP32_WEIGHTS[0]) if firsts else 0.0

    return models.remember(("least first bucket", id(segments), tp), made)[1]


def _zero3_least(least: float, choices: Choices, models: CostModels) -> float:
    """ZeRO-3's collectives a pipeline rank leaves unhidden per microbatch at least
    (`_zero3_comm`), its first bucket holding at least `least` parameters: that bucket's
    gather before its forward and its gradients' reduce-scatter after its backward (a
    collective takes no less for more bytes). Under expert parallelism, none."""
    comm = models.comm
    if choices.zero != 3 or choices.ep > 1 or choices.dp == 1 or not least:
        return 0.0
    if comm.measures_zero3_buckets:
        return 0.0
    group = (choices.dp, choices.degrees.stride(Axis.DP))
    param_bytes, grad_bytes = choices.state_bytes[0], choices.reduced_grad_bytes
    return comm.time(ALL_GATHER, least * param_bytes, *group) + comm.time(
        REDUCE_SCATTER, least * grad_bytes, *group
    )


def once_per_step_floor(params: float, choices: Choices, models: CostModels) -> float:
    """What a step adds at least once its microbatches are done, `params` the
    parameters one rank of tp × ep holds over all stages: on the pipeline rank holding
    the most, at least the mean share, the optimizer step over its shard
    (`_optimizer_time`: the norm's read, the step's sums, Adam's pass over the bytes,
    and under ZeRO-3 one flat shard per bucket, each holding at most the cap), the
    gradients' memory traffic (`_gradient_traffic`) and under ZeRO-1/2 the parameters'
    all-gathers after the step (`_dp_sync`), each growing with the parameters; the rest
    at 0."""
    zero, split = choices.zero, choices.degrees.batch_split
    params /= choices.pp
    shard = params / split
    step = _step_sums_time(shard, choices, models)
    if not choices.offload:
        state = (shard if zero and split > 1 else params) * sum(choices.state_bytes)
        buckets = params / (ZERO3_BUCKET_BYTES / FP32_WEIGHTS[0]) if zero == 3 else 0.0
        step += models.compute.optimizer_step_time(state, buckets if split > 1 else 0.0)
    step += _gradient_traffic(params, choices, models)
    if zero in (1, 2) and split > 1 and choices.ep == 1 and choices.sync_every is None:
        size, stride = _sync_group(choices)
        if size > 1:
            param_bytes = choices.state_bytes[0]
            step += _bucketed(ALL_GATHER, params * param_bytes, size, stride, models)[0]
    return step


def _zero3_floor(
    forward: float, later: float, params: float, choices: Choices, models: CostModels
) -> float:
    """What ZeRO-3's collectives add at least to the ranks' summed time for a microbatch
    (`_zero3_comm`), given their summed compute in forward and after it, and the
    parameters one rank of tp holds over all stages: every parameter gathered in forward
    and in backward and its gradient reduce-scattered, each collective at its
    algorithm's least seconds per byte (a collective's time is at least that times its
    bytes); where collectives hide behind compute, a pass costs at least the larger of
    its compute and its collectives. With experts (their own groups), none."""
    if choices.zero != 3 or choices.ep > 1 or choices.dp == 1:
        return 0.0
    size, stride, comm = choices.dp, choices.degrees.stride(Axis.DP), models.comm
    param_bytes, grad_bytes = choices.state_bytes[0], choices.reduced_grad_bytes
    if comm.measures_zero3_buckets:
        per_byte = _per_byte(lambda b: comm.zero3_bucket_time(b, size))
        return params * (param_bytes + grad_bytes) / 2 * per_byte
    gathers = params * param_bytes * _per_byte(lambda b: comm.time(ALL_GATHER, b, size, stride))
    scatters = params * grad_bytes * _per_byte(lambda b: comm.time(REDUCE_SCATTER, b, size, stride))
    if not comm.overlaps_compute:
        return 2 * gathers + scatters
    return max(0.0, gathers - forward) + max(0.0, gathers + scatters - later)


def _per_byte(seconds: Callable[[float], float]) -> float:
    """The least seconds per byte of a collective whose time is the least of its
    algorithms', each a latency and a rate (or sums of such leasts): its slope at a size
    far past where the algorithms cross, where the slowest-growing one is the least."""
    far = 1e15
    return (seconds(2 * far) - seconds(far)) / far


def rank_segments(
    summary: GraphSummary, at: Mapping[str, int], choices: Choices
) -> tuple[SegmentWork, ...]:
    """Every segment's work on one rank, per microbatch: its tp share, under context
    parallelism of its 1/cp of the tokens (priced as 1/cp of the batch) but for what
    the rewrite runs on the whole sequence (`GraphSummary.context_parallel`). The
    summary's own tuple, the same object for every plan that asks alike."""
    return summary.context_parallel(at, choices.tp, choices.cp)


def _segment_times(
    segments: Sequence[SegmentWork], choices: Choices, models: CostModels
) -> tuple[PhaseCost, ...]:
    """`segment_times` under the plan's recomputation, worked out once for the plans
    that recompute alike on these segments (a deep pipeline's floors ask it at every
    depth)."""
    key = (
        "segment times",
        id(segments),
        choices.recompute,
        choices.recompute_attention,
        choices.precision,
        choices.compiled,
    )

    def made() -> tuple[Sequence[SegmentWork], tuple[PhaseCost, ...]]:
        recomputed = [choices.recomputes(s) for s in segments]
        attention = [choices.recomputes_attention(s) for s in segments]
        return segments, tuple(segment_times(segments, models.compute, recomputed, attention))

    return models.remember(key, made)[1]


def segment_times(
    segments: Sequence[SegmentWork],
    compute: ComputeModel,
    recomputed: Sequence[bool],
    attention_recomputed: Sequence[bool] | None = None,
) -> list[PhaseCost]:
    """Each segment's seconds per microbatch, recomputed whole, its attention core
    alone, or not at all; one block instance priced per block."""
    cache: dict[tuple[str, bool, bool], PhaseCost] = {}
    out: list[PhaseCost] = []
    selective = attention_recomputed or [False] * len(segments)
    for seg, recompute, core in zip(segments, recomputed, selective):
        key = (seg.segment.block_id or f"segment {len(out)}", recompute, core)
        if key not in cache:
            cache[key] = compute.cost(seg.nodes, recompute)
            if core and not recompute:
                cache[key] += attention_recompute_cost(seg, compute)
        out.append(cache[key])
    return out


def attention_recompute_cost(seg: SegmentWork, compute: ComputeModel) -> PhaseCost:
    """What recomputing a segment's attention cores alone adds: their forward again."""
    return PhaseCost(recompute=compute.cost(seg.attention_core, recompute=True).recompute)


@dataclass(frozen=True, slots=True)
class _StageWork:
    """What a pipeline rank's segments cost whatever its position in the pipeline: ranks
    holding alike segments (the middle ranks of a transformer's pipeline) share it."""

    compute: PhaseCost
    params: float
    experts: float
    boundary: float
    blocks: int
    gathered: float
    tp: float
    # ZeRO-3's, context parallelism's, the experts' all_to_alls, the batch norms' sums
    other_comm: float
    ep: float
    activations: Activations
    unrecomputed: Activations
    recomputed: int
    attention_recomputed: int
    recompute_comm: float
    sync: float
    optimizer: float


def _stage_work(
    stage: _Stage,
    last: SegmentWork | None,
    compute: PhaseCost,
    choices: Choices,
    models: CostModels,
    traffic: float,
) -> _StageWork:
    params = stage.params
    plain = not choices.recompute and not choices.recompute_attention
    held = (_plain_holdings if plain else _holdings)(stage, choices, models)
    experts, norms, mixing = held.syncs
    zero3, cp = _zero3_comm(stage, compute, choices, models), _cp_comm(stage, last, choices, models)
    other_comm = zero3 + cp + experts + norms + mixing
    return _StageWork(
        compute=compute,
        params=params,
        experts=stage.experts,
        boundary=held.boundary,
        blocks=held.blocks,
        gathered=held.gathered,
        tp=held.tp,
        other_comm=other_comm,
        ep=experts,
        activations=held.activations,
        unrecomputed=held.unrecomputed,
        recomputed=held.recomputed,
        attention_recomputed=held.attention_recomputed,
        recompute_comm=held.recompute_comm,
        sync=_dp_sync(stage, compute, choices, models, traffic),
        optimizer=_optimizer_time(stage, compute, choices, models)
        + _gradient_traffic(params, choices, models),
    )


@dataclass(frozen=True, slots=True)
class _Holdings:
    """What a stage's segments add up to whatever the ranks' data parallelism: its
    blocks, their largest output and gathered parameters, its tensor-parallel
    collectives, activations, recomputation, and its collectives of experts, batch
    norms and batch mixing (`syncs`, in that order)."""

    boundary: float
    blocks: int
    gathered: float
    tp: float
    activations: Activations
    unrecomputed: Activations
    syncs: tuple[float, float, float]
    recomputed: int = 0
    attention_recomputed: int = 0
    recompute_comm: float = 0.0


def _syncs(own: list[SegmentWork], choices: Choices, comm: CommModel) -> tuple[float, float, float]:
    return (
        all_to_all_comm(own, choices, comm),
        norm_sync_comm(own, choices, comm),
        mixing_sync_comm(own, choices, comm),
    )


def _holdings(stage: _Stage, choices: Choices, models: CostModels) -> _Holdings:
    """`_Holdings` segment by segment, each recomputed or not."""
    own, comm = stage.own, models.comm
    blocks = [s for s in own if s.is_block]
    recomputed = [s for s in own if choices.recomputes(s)]
    return _Holdings(
        boundary=max((s.output_bytes for s in blocks), default=0.0),
        blocks=len(blocks),
        gathered=max((zero3_gathered(s, choices) for s in blocks), default=stage.params),
        tp=_tp_comm(own, choices, comm),
        activations=_activations(own, choices),
        unrecomputed=Activations(
            kept=sum(s.saved_bytes(choices.precision, choices.compiled) for s in own)
        ),
        syncs=_syncs(own, choices, comm),
        recomputed=len(recomputed),
        attention_recomputed=sum(choices.recomputes_attention(s) for s in own),
        recompute_comm=sum(
            tp_comm(s, choices, comm, True) - tp_comm(s, choices, comm, False) for s in recomputed
        ),
    )


def _plain_holdings(stage: _Stage, choices: Choices, models: CostModels) -> _Holdings:
    """`_holdings` of a plan that recomputes nothing, as the search prices most: summed
    from the columns (`_Columns`) in the order `_holdings` adds them, so that both give
    the same figures to the last bit."""
    columns = stage.columns
    blocks = sum(stage.column(columns.is_block))
    if not blocks:
        gathered = stage.params
    elif choices.ep == 1:  # one kind of bucket, gathered where dp > 1
        gathered = max(stage.column(columns.block_params)) if choices.dp > 1 else 0
    else:
        gathered = max(zero3_gathered(s, choices) for s in stage.own if s.is_block)
    syncs = _syncs(stage.own, choices, models.comm) if columns.syncs else (0.0, 0.0, 0.0)
    saved = Activations(kept=sum(stage.column(columns.saved)))
    return _Holdings(
        boundary=max(stage.column(columns.block_outputs), default=0.0),
        blocks=blocks,
        gathered=gathered,
        tp=sum(stage.column(columns.tp)),
        activations=saved,
        unrecomputed=saved,
        syncs=syncs,
    )


@dataclass(frozen=True, slots=True)
class _Columns:
    """Per segment of a plan's list (`rank_segments`), what a pipeline rank's stage adds
    up, worked out once for every plan the search prices on that list with the same
    tp, ep, precision and compilation (`CostModels.remembered`): a rank's sums are then
    sums of slices, in segment order. `segments` is kept, so that its id is not reused
    while the columns live."""

    segments: tuple[SegmentWork, ...]
    kinds: list[str]  # a block's id, another segment's key: segments alike have one kind
    params: list[float]  # held by one rank of tp × ep
    experts: list[float]
    tensors: list[int]
    saved: list[float]  # saved for backward, nothing recomputed
    tp: list[float]  # tensor-parallel collectives, nothing recomputed
    is_block: list[int]
    block_outputs: list[float]  # a block's output bytes; 0 for other segments
    block_params: list[float]  # a block's parameters; 0 for other segments
    syncs: bool  # whether any segment has batch-norm sums, batch mixing or expert exchanges

    @classmethod
    def of(
        cls, segments: tuple[SegmentWork, ...], choices: Choices, models: CostModels
    ) -> _Columns:
        key = ("columns", id(segments), choices.tp, choices.ep, choices.precision, choices.compiled)
        return models.remember(key, lambda: cls._made(segments, choices, models.comm))

    @classmethod
    def _made(
        cls, segments: tuple[SegmentWork, ...], choices: Choices, comm: CommModel
    ) -> _Columns:
        tp, ep = choices.tp, choices.ep
        params = [s.param_numel(tp, ep) for s in segments]
        blocks = [int(s.is_block) for s in segments]
        return cls(
            segments,
            [s.segment.block_id or s.key for s in segments],
            params,
            [s.expert_numel(ep, tp) for s in segments],
            [s.param_tensors for s in segments],
            [s.saved_bytes(choices.precision, choices.compiled) for s in segments],
            [tp_comm(s, choices, comm, False) for s in segments],
            blocks,
            [s.output_bytes if b else 0.0 for s, b in zip(segments, blocks, strict=True)],
            [p if b else 0.0 for p, b in zip(params, blocks, strict=True)],
            any(
                s.segment.norm_channels
                or s.gathered_bytes
                or s.segment.statistics
                or s.segment.expert_rows
                for s in segments
            ),
        )


@dataclass(frozen=True, slots=True)
class _Stage:
    """A pipeline rank's segments: `own`, the `spans` of the plan's list they fill (one
    per chunk the rank holds), their `columns`, and what they hold, summed once: the
    parameters on one rank of tp × ep, of them the experts', and parameter tensors."""

    own: list[SegmentWork]
    spans: tuple[tuple[int, int], ...]
    columns: _Columns
    params: float
    experts: float
    tensors: int

    @classmethod
    def of(
        cls,
        segments: tuple[SegmentWork, ...],
        spans: tuple[tuple[int, int], ...],
        columns: _Columns,
    ) -> _Stage:
        return cls(
            list(_in_spans(segments, spans)),
            spans,
            columns,
            sum(_in_spans(columns.params, spans)),
            sum(_in_spans(columns.experts, spans)),
            sum(_in_spans(columns.tensors, spans)),
        )

    def column(self, values: Sequence[T]) -> Iterable[T]:
        """The stage's entries of one of its columns, in segment order."""
        return _in_spans(values, self.spans)

    @property
    def identity(self) -> tuple:
        """What tells its segments apart from another stage's, cheaply: the first
        segment and the spans (the graph's segments, whatever the microbatch)."""
        return (id(self.own[0].segment) if self.own else None, self.spans)


def _in_spans(values: Sequence[T], spans: tuple[tuple[int, int], ...]) -> Iterable[T]:
    if len(spans) == 1:
        a, b = spans[0]
        return values[a:b]
    return itertools.chain.from_iterable(values[a:b] for a, b in spans)


def _rank_spans(chunk_of: Sequence[int], pp: int) -> list[tuple[tuple[int, int], ...]]:
    """Per pipeline rank, the spans [a, b) of the segment list its chunks fill (chunk c
    runs on rank c mod pp; each chunk is contiguous)."""
    spans: list[list[tuple[int, int]]] = [[] for _ in range(pp)]
    start = 0
    for i in range(1, len(chunk_of) + 1):
        if i == len(chunk_of) or chunk_of[i] != chunk_of[start]:
            spans[chunk_of[start] % pp].append((start, i))
            start = i
    return [tuple(s) for s in spans]


def _rank_cost(
    rank: int,
    spans: tuple[tuple[int, int], ...],
    segments: tuple[SegmentWork, ...],
    times: Sequence[PhaseCost],
    choices: Choices,
    models: CostModels,
    traffic: float = 1.0,
    shared: dict | None = None,
) -> RankCost:
    """`traffic`: the fraction of the gradients' bytes the dp all-reduce moves. `shared`:
    the `_StageWork` of the plan's other ranks, by what their segments are (copies of
    one block cost alike, as `segment_times` prices them)."""
    columns = _Columns.of(segments, choices, models)
    last = segments[-1] if spans and spans[-1][1] == len(segments) else None
    stage: _Stage | None = None
    kinds: tuple
    if choices.recompute or choices.recompute_attention:
        stage = _Stage.of(segments, spans, columns)
        kinds = tuple(
            (s.segment.block_id or s.key, choices.recomputes(s), choices.recomputes_attention(s))
            for s in stage.own
        )
    else:  # nothing recomputed: what each segment is tells them apart
        kinds = tuple(_in_spans(columns.kinds, spans))
    alike = (kinds, last is not None)
    work = shared.get(alike) if shared is not None else None
    if work is None:
        stage = stage or _Stage.of(segments, spans, columns)
        compute = sum(stage.column(times), PhaseCost())
        regions = _regions(stage, choices, models)
        compute += models.compute.region_time(regions, stage.tensors)
        work = _stage_work(stage, last, compute, choices, models, traffic)
        if shared is not None:
            shared[alike] = work
    comm = work.tp + p2p_comm(work.boundary, choices, models, rank) + work.other_comm
    in_flight = in_flight_microbatches(
        choices.schedule, choices.microbatches, choices.pp, rank, choices.virtual_stages
    )
    output = last.output_bytes * choices.cp if last else 0.0  # 1/tp if split; whole over cp
    # The loss's output-sized gradients are freed once the head's backward has used them,
    # before backward reaches a recomputed block: the two are never live together.
    largest = work.activations.largest_recomputed
    activations = work.activations.bytes(in_flight) - min(largest, OUTPUT_GRADIENTS * output)
    memory = models.memory.breakdown(
        work.params,
        choices.dp,
        choices.zero,
        activations=activations,
        gathered_params=work.gathered,
        pipeline_bytes=work.boundary if choices.pp > 1 else 0.0,
        output_bytes=output,
        offload=choices.offload,
        experts=work.experts,
        ep=choices.ep,
        master_weights=choices.master_weights,
    )
    memory["optimizer"] += round(choices.outer_copies * work.params * choices.state_bytes[0])
    figures = StageFigures(
        blocks=work.blocks,
        microbatch_s=work.compute.total + comm,
        peak_memory_bytes=total(memory),
        in_flight=in_flight,
        recomputed=work.recomputed,
        attention_recomputed=work.attention_recomputed,
        recompute_frees_bytes=round(work.unrecomputed.bytes(in_flight) - activations),
        recompute_s=choices.microbatches * (work.compute.recompute + work.recompute_comm),
        tp_comm_s=choices.microbatches * work.tp,
        ep_comm_s=choices.microbatches * work.ep,
    )
    return RankCost(
        compute=work.compute,
        comm=comm,
        sync=work.sync,
        optimizer=work.optimizer,
        memory=memory,
        figures=figures,
    )


def _regions(stage: _Stage, choices: Choices, models: CostModels) -> int:
    """Compiled regions a pipeline rank runs per microbatch (`fusion.regions_per_call`):
    one per chunk it holds, and two more per ZeRO-3 gather, which stays out of the
    compiled graph."""
    if not choices.compiled:
        return 0
    gathers = (
        sum(
            _gather_tally(stage, kind, models).number
            for kind in _zero3_groups(choices)
            if kind.group[0] > 1
        )
        if choices.zero == 3 and choices.degrees.batch_split > 1
        else 0
    )
    return regions_per_call(gathers) + choices.virtual_stages - 1


def _cp_comm(
    stage: _Stage, last: SegmentWork | None, choices: Choices, models: CostModels
) -> float:
    """Per microbatch under context parallelism: the rings of attention, the
    conversions to and from what runs on the whole sequence, the gradient all-reduces
    over cp, the logits' gather (`context.py`)."""
    cp, tp = choices.cp, choices.tp
    if cp == 1:
        return 0.0
    own, comm = stage.own, models.comm
    recomputed = [choices.recomputes(s) for s in own]
    rings = ring_comm(own, cp, tp, choices.precision, recomputed, comm, models.compute)
    conversions = conversion_comm(own, cp, tp, choices.precision, recomputed, comm)
    grad_bytes = choices.state_bytes[1]
    in_sync = choices.cp_in_sync
    gradients = (
        0.0
        if in_sync
        else gradient_all_reduces(stage.params, cp, tp, grad_bytes, comm, stage.tensors)
    )
    logits = output_gather(last.output_bytes, cp, tp, comm) if last else 0.0
    return rings + conversions + gradients + logits


def _tp_comm(own: Sequence[SegmentWork], choices: Choices, comm: CommModel) -> float:
    return sum(tp_comm(seg, choices, comm, choices.recomputes(seg)) for seg in own)


def tp_comm(seg: SegmentWork, choices: Choices, comm: CommModel, recomputed: bool) -> float:
    """Per microbatch of a segment: its tensor-parallel collectives under the plan's
    layout, those of forward again where it is recomputed; activations captured in
    fp32 travel in 16 bits under mixed precision. Without a layout, a block's Megatron
    collectives: 2 forward + 2 backward all-reduces of its output."""
    tp = choices.tp
    if tp == 1:
        return 0.0
    mixed = is_mixed(choices.precision)
    if seg.tp_traffic is None:
        if not seg.is_block:
            return 0.0
        count = TP_ALL_REDUCES_FORWARD * (1 + recomputed) + TP_ALL_REDUCES_BACKWARD
        scale = 0.5 if mixed and not seg.low_precision_output else 1.0
        return count * comm.time(ALL_REDUCE, seg.output_bytes * scale, tp)
    return sum(
        comm.time(op, nbytes * (mixed_scale if mixed else 1.0), tp)
        * count
        * (1 if backward else 1 + recomputed)
        for op, nbytes, backward, mixed_scale, count in seg.tp_traffic
    )


def p2p_comm(boundary: float, choices: Choices, models: CostModels, rank: int = 0) -> float:
    """Per microbatch on pipeline rank `rank`: what it sends, each chunk it holds its
    activation to the next chunk (but the last chunk) and its gradient to the one before
    (but the first), on the link to that chunk's rank (NVLink inside a node, the
    sender's NIC between nodes: `CommModel.send_time`). Interleaved chunks wrap around,
    from the last rank to the first. What a rank receives is its peer's send, issued in
    one batch with a send of its own (`pipeline` module docstring)."""
    if choices.pp == 1:
        return 0.0
    link_send_time = models.comm.link_send_time
    return sum(link_send_time(boundary, crosses) for crosses in _send_links(choices, models)[rank])


def pipeline_sends(boundary: float, choices: Choices, models: CostModels) -> float:
    """`p2p_comm` summed over the pipeline's ranks, the sends counted by whether they
    cross nodes and each kind priced once: a deep pipeline's step floor asks this at
    every microbatch size."""
    if choices.pp == 1:
        return 0.0
    key = ("send links counted", choices.pp, choices.chunks, choices.degrees.stride(Axis.PP))
    links = models.remember(key, lambda: Counter(itertools.chain(*_send_links(choices, models))))
    comm = models.comm
    return sum(n * comm.link_send_time(boundary, crosses) for crosses, n in links.items())


def _send_links(choices: Choices, models: CostModels) -> tuple[tuple[bool, ...], ...]:
    """Per pipeline rank, whether each of its sends (`p2p_comm`, in order) crosses
    nodes: all a send's price reads of where its pair sits, worked out once for the
    pipelines of these degrees (the search prices thousands, deep ones at every
    microbatch size)."""
    pp, chunks, stride = choices.pp, choices.chunks, choices.degrees.stride(Axis.PP)
    comm = models.comm

    def made() -> tuple[tuple[bool, ...], ...]:
        return tuple(
            tuple(
                comm.crosses_nodes(rank * stride, peer % pp * stride, stride)
                for peer in _peer_chunks(rank, pp, chunks)
                if peer % pp != rank  # a chunk sending to its own rank sends nothing
            )
            for rank in range(pp)
        )

    return models.remember(("send links", pp, chunks, stride), made)


def _peer_chunks(rank: int, pp: int, chunks: int) -> list[int]:
    """The chunks pipeline rank `rank`'s chunks send to: each the next (but the last
    chunk) and the one before (but the first)."""
    return [
        peer
        for chunk in range(rank, chunks, pp)
        for peer, sends in ((chunk + 1, chunk + 1 < chunks), (chunk - 1, chunk > 0))
        if sends
    ]


def _zero3_comm(stage: _Stage, compute: PhaseCost, choices: Choices, models: CostModels) -> float:
    """Per microbatch under ZeRO-3, as the runtime runs it (`ops/zero3.py`): each
    gather of a parameter bucket (`_gathers`: a tied weight read far from its bucket is
    gathered again) is issued in forward, again in backward, and its gradients
    reduce-scattered. A gather is issued one bucket ahead and reduce-scatters
    travel while backward goes on, so each pass's first gather and the last
    reduce-scatter show and the others hide behind the pass's compute while it lasts
    (nothing hides on Gloo). Where the profile measured what a bucket's three
    collectives add run so together (a CPU's), each bucket costs that."""
    if choices.zero != 3 or choices.degrees.batch_split == 1:
        return 0.0
    param_bytes, grad_bytes = choices.state_bytes[0], choices.reduced_grad_bytes
    comm = models.comm
    # A 1T model's rank issues thousands of gathers, nearly all of one bucket size:
    # counted, and priced once per size.
    tallies = [
        (tally, kind.group)
        for kind in _zero3_groups(choices)
        if kind.group[0] > 1
        for tally in [_gather_tally(stage, kind, models)]
        if tally.number
    ]
    alike: Counter[tuple[float, int, int]] = Counter()  # (parameters, ranks, stride)
    for tally, (size, stride) in tallies:
        for b, n in tally.counts.items():
            alike[b, size, stride] += n
    if comm.measures_zero3_buckets:
        mean_bytes = (param_bytes + grad_bytes) / 2
        return sum(
            n * comm.zero3_bucket_time(b * mean_bytes, size) for (b, size, _), n in alike.items()
        )
    if not tallies:
        return 0.0

    def gather(b: float, size: int, stride: int) -> float:
        return comm.time(ALL_GATHER, b * param_bytes, size, stride)

    def scatter(b: float, size: int, stride: int) -> float:
        return comm.time(REDUCE_SCATTER, b * grad_bytes, size, stride)

    gathers = sum(n * gather(*b) for b, n in alike.items())
    scatters = sum(n * scatter(*b) for b, n in alike.items())
    first = (tallies[0][0].first, *tallies[0][1])
    last = (tallies[-1][0].last, *tallies[-1][1])
    forward = gather(*first) + max(0.0, gathers - gather(*first) - _hiding(compute.forward, models))
    # Backward runs the buckets in reverse.
    overlapped = gathers - gather(*last) + scatters - scatter(*first)
    backward = gather(*last) + scatter(*first)
    hiding = _hiding(compute.backward + compute.recompute, models)
    return forward + backward + max(0.0, overlapped - hiding)


@dataclass(frozen=True, slots=True)
class _Zero3Kind:
    """A kind of ZeRO-3 bucket: which parameters (`part`: "all", the "shared" weights or
    the "experts") one rank of `tp` × `ep` holds, and the (ranks, stride) they are
    sharded over."""

    part: str
    tp: int
    ep: int
    group: tuple[int, int]

    def numel(self, seg: SegmentWork) -> float:
        if self.part == "experts":
            return seg.expert_numel(self.ep, self.tp)
        held = seg.param_numel(self.tp, self.ep)
        return held - seg.expert_numel(self.ep, self.tp) if self.part == "shared" else held


def _zero3_groups(choices: Choices) -> list[_Zero3Kind]:
    """ZeRO-3's kinds of bucket. Under expert parallelism the experts' over their dp
    replicas (`_expert_group`), the other weights' over dp × ep."""
    tp, ep = choices.tp, choices.ep
    if ep == 1:
        return [_Zero3Kind("all", tp, ep, (choices.dp, choices.degrees.stride(Axis.DP)))]
    return [
        _Zero3Kind("shared", tp, ep, (choices.dp * ep, choices.degrees.stride(Axis.EP))),
        _Zero3Kind("experts", tp, ep, _expert_group(choices)),
    ]


def zero3_gathered(seg: SegmentWork, choices: Choices) -> float:
    """The parameters of `seg` ZeRO-3 gathers whole (an expert with one replica is held
    whole, not gathered)."""
    return sum(kind.numel(seg) for kind in _zero3_groups(choices) if kind.group[0] > 1)


def _hiding(compute: float, models: CostModels) -> float:
    """The compute that asynchronous collectives can hide behind: none on Gloo
    (`CommModel.overlaps_compute`)."""
    return compute if models.comm.overlaps_compute else 0.0


def _dp_sync(
    stage: _Stage,
    compute: PhaseCost,
    choices: Choices,
    models: CostModels,
    traffic: float,
) -> float:
    """Once per step: ZeRO-0/1 gradient reduction (`traffic` of its bytes, where it
    is compressed), hidden behind the last microbatch's backward but for its last
    bucket; ZeRO-2 reduces every microbatch's gradients (`runtime/zero_replicas.py`),
    m reductions hidden behind m backwards but for the last bucket; ZeRO-1/2's
    parameter all-gathers after the step, one a bucket. Under context parallelism
    with plain data parallelism the reduction spans dp × cp (it sums cp's parts); under
    expert parallelism the replicated weights' spans dp × ep, and the experts' dp."""
    size, stride = _sync_group(choices)
    if choices.zero == 3:
        return 0.0
    if choices.sync_every is not None:
        return _local_sgd_sync(stage.own, compute, choices, models)
    experts = stage.experts if choices.ep > 1 else 0.0
    params = stage.params - experts
    param_bytes, grad_bytes = choices.state_bytes[0], choices.reduced_grad_bytes
    op = ALL_REDUCE if choices.zero == 0 else REDUCE_SCATTER
    rounds = choices.microbatches if choices.zero == 2 else 1
    hiding = _hiding((compute.backward + compute.recompute) * rounds, models)
    exposed = 0.0
    for group, numel in (((size, stride), params), (_expert_group(choices), experts)):
        if group[0] > 1 and numel:
            sync, last = _bucketed(op, numel * grad_bytes * traffic, *group, models)
            sync *= rounds
            exposed += exposed_sync(sync, hiding, last)
            hiding = max(0.0, hiding - sync)
    if choices.zero == 0:
        return exposed
    # ZeRO-1/2: every bucket's shard gathered back after the step, over its own group,
    # one all-gather a bucket as the reduction took one.
    for group, numel in (((size, stride), params), (_expert_group(choices), experts)):
        if group[0] > 1 and numel:
            exposed += _bucketed(ALL_GATHER, numel * param_bytes, *group, models)[0]
    return exposed


def _gradient_traffic(params: float, choices: Choices, models: CostModels) -> float:
    """Once per step, what the gradients of the rank's `params` parameters cost in
    memory traffic outside the graph's operators, in passes over their bytes G. Under
    data parallelism (ZeRO-0 and 1: `runtime/grad_sync.py`, `zero_replicas.py`) they
    accumulate into flat buckets, zeroed before the step (G), every microbatch's added
    in (3G: two reads, a write), then divided in place before their reduction (2G);
    ZeRO-2 takes each backward's fresh gradients, flattened and divided (4G a
    microbatch); ZeRO-1 and 2 copy the gathered parameters back after the step (2 passes
    over their bytes). Without a reduction, the first microbatch's gradients are the
    step's and every later one is added in. ZeRO-3's buckets are priced with its
    collectives."""
    split = choices.degrees.batch_split > 1
    if split and choices.zero == 3:
        return 0.0
    param_bytes, grad_bytes = choices.state_bytes[:2]
    m = choices.microbatches
    if not split or choices.sync_every is not None:
        passes = 3 * (m - 1)
    elif choices.zero == 2:
        passes = 4 * m
    else:
        passes = 1 + 3 * m + 2
    copied_back = 2 * param_bytes if split and choices.zero in (1, 2) else 0
    traffic = params * (passes * grad_bytes + copied_back)
    return traffic / models.compute.device.memory_bandwidth


def _local_sgd_sync(
    own: list[SegmentWork], compute: PhaseCost, choices: Choices, models: CostModels
) -> float:
    """Local SGD, per step: one all-reduce of every parameter's value (as the optimizer
    holds it) over the replicas every `sync_every` steps, after the optimizer step
    (nothing to hide it). Under expert parallelism a replica spans ep, whose ranks
    average the other weights' gradients every step (hidden behind backward but for
    the last bucket), and the replicas are the dp ranks that hold the same experts."""
    ep = choices.ep
    params = sum(s.param_numel(choices.tp, ep) for s in own)
    param_bytes, grad_bytes = choices.state_bytes[:2]
    replicas = _expert_group(choices) if ep > 1 else _sync_group(choices)
    averaging = (
        models.comm.time(ALL_REDUCE, params * param_bytes, *replicas) / (choices.sync_every or 1)
        if replicas[0] > 1
        else 0.0
    )
    if ep == 1:
        return averaging
    others = params - sum(s.expert_numel(ep, choices.tp) for s in own)
    sync, last = _bucketed(
        ALL_REDUCE, others * grad_bytes, ep, choices.degrees.stride(Axis.EP), models
    )
    hiding = _hiding(compute.backward + compute.recompute, models)
    return averaging + exposed_sync(sync, hiding, last)


def _sync_group(choices: Choices) -> tuple[int, int]:
    """(ranks, stride) of the gradient sync's group: dp, or dp × cp where the sync also
    sums context parallelism's parts (`policy.cp_gradients_in_sync`), or dp × ep (the
    ranks that split the batch) under expert parallelism."""
    if choices.cp > 1 and choices.cp_in_sync:
        return choices.dp * choices.cp, choices.degrees.stride(Axis.CP)
    if choices.ep > 1:
        return choices.dp * choices.ep, choices.degrees.stride(Axis.EP)
    return choices.dp, choices.degrees.stride(Axis.DP)


def _expert_group(choices: Choices) -> tuple[int, int]:
    """(ranks, stride) of the experts' gradient sync: their dp replicas."""
    return choices.dp, choices.degrees.stride(Axis.DP)


def _bucketed(
    op: str, nbytes: float, size: int, stride: int, models: CostModels
) -> tuple[float, float]:
    """(every bucket, the last bucket): seconds of `op` over the sync's `size` ranks,
    `stride` apart, on `nbytes` of gradients (or parameters) cut into the memory model's
    buckets."""
    memory = models.memory
    runs = bucket_runs(nbytes, memory.bucket_bytes, memory.first_bucket_bytes)
    seconds = [(models.comm.time(op, b, size, stride), n) for b, n in runs]
    return sum(t * n for t, n in seconds), seconds[-1][0] if seconds else 0.0


def _optimizer_time(
    stage: _Stage, compute: PhaseCost, choices: Choices, models: CostModels
) -> float:
    """Adam touches this rank's parameters, gradients and state: all of them, or its
    shards of them under ZeRO (1/dp; under ep the experts' 1/dp and the other weights'
    1/(dp·ep)), whose optimizer steps one flat shard per bucket instead of the
    parameter tensors (`ops/flat_buckets.py`): ZeRO-1/2 bucket the gradients as
    data parallelism does, ZeRO-3 the parameters of each block and of each run of
    segments between blocks (`passes/zero.py`). Offloaded, it runs on the host. Before
    it, every step reads the gradients it steps once for their norm, and sums the
    loss, the norm and the inputs' checksums over the world (runtime/step_sums.py);
    ZeRO-1 and 2 handle the parameter tensors one by one around it
    (`_flat_copies_time`)."""
    shard = (stage.params - stage.experts) / choices.degrees.batch_split
    shard += stage.experts / choices.dp
    update = _update_time(stage, shard, compute, choices, models)
    copies = _flat_copies_time(stage.tensors, choices, models)
    return _step_sums_time(shard, choices, models) + update + copies


def _flat_copies_time(tensors: float, choices: Choices, models: CostModels) -> float:
    """Once per step, what ZeRO-1 and 2 pay for each of the rank's `tensors` parameter
    tensors beyond its bytes (`_gradient_traffic`), as `runtime/zero_replicas.py` runs
    them: a view into the gathered flat buffer to copy the updated values back from after
    the step, and under ZeRO-2 a view into every microbatch's flat gradients to copy its
    gradient into. Each is an operator's dispatch, at the calibrated floor, as the
    optimizer's per-tensor work is priced. ZeRO-0 and 1 accumulate the gradients into
    their buckets' views in place, as one device accumulates them."""
    if choices.zero not in (1, 2) or choices.degrees.batch_split == 1:
        return 0.0
    passes = 1 + (choices.microbatches if choices.zero == 2 else 0)
    return tensors * passes * models.compute.device.kernel_launch_s


def _step_sums_time(shard: float, choices: Choices, models: CostModels) -> float:
    """The gradient norm's read of this rank's gradients, and the step's one all-reduce
    of a few values over every rank."""
    norm = shard * choices.state_bytes[1] / models.compute.device.memory_bandwidth
    world = choices.degrees.world_size
    return norm + (models.comm.time(ALL_REDUCE, STEP_SUMS_BYTES, world) if world > 1 else 0.0)


def _update_time(
    stage: _Stage,
    shard: float,
    compute: PhaseCost,
    choices: Choices,
    models: CostModels,
) -> float:
    """The optimizer's own pass over the rank's `shard` of the parameters."""
    params = stage.params
    per_param = sum(choices.state_bytes)
    if choices.offload:
        # ZeRO-1/2's buckets and a single replica's parameters go down as they become
        # final, during backward; ZeRO-3's shards once it is over.
        overlapped = choices.zero < 3 or choices.degrees.batch_split == 1
        return host_step_time(
            shard,
            _hiding(compute.backward + compute.recompute, models) if overlapped else 0.0,
            choices.state_bytes,
            models.comm.mesh.device,
            last_bytes=models.memory.bucket_bytes / choices.degrees.batch_split,  # its shard
            tile_bytes=models.memory.bucket_bytes,
        )
    if choices.zero == 0 or choices.degrees.batch_split == 1:
        return models.compute.optimizer_step_time(params * per_param, stage.tensors)
    if choices.zero == 3:
        shards = sum(_gather_tally(stage, kind, models).buckets for kind in _zero3_groups(choices))
    else:
        grad_bytes = params * choices.state_bytes[1]
        memory = models.memory
        runs = bucket_runs(grad_bytes, memory.bucket_bytes, memory.first_bucket_bytes)
        shards = sum(n for _, n in runs)
    return models.compute.optimizer_step_time(shard * per_param, shards)


def _buckets_of(
    own: list[SegmentWork], numel: Callable[[SegmentWork], float]
) -> tuple[list[float], list[range]]:
    """ZeRO-3's buckets (`passes/zero.py`) of the parameters `numel` counts, as parameter
    counts: one per block holding parameters and one per run of other segments holding
    them, each split at the pass's cap on fp32 bytes; and for each segment the buckets
    holding those it owns."""
    cap = ZERO3_BUCKET_BYTES / FP32_WEIGHTS[0]
    buckets: list[float] = []
    of_segment: list[range] = []
    in_run = False
    for seg in own:
        params = numel(seg)
        if params and (seg.is_block or not in_run):
            buckets.append(0.0)
        start = len(buckets) - 1 if params else len(buckets)
        if params > 0:
            # Fill the open bucket, then whole buckets of `cap`, then the rest.
            first = min(params, max(0.0, cap - buckets[-1]))
            buckets[-1] += first
            whole, rest = divmod(params - first, cap)
            buckets += [cap] * int(whole) + ([rest] if rest > 0 else [])
        of_segment.append(range(start, len(buckets)))
        in_run = (in_run or params > 0) and not seg.is_block
    return buckets, of_segment


def _gathers(
    own: list[SegmentWork], buckets: list[float], of_segment: list[range]
) -> tuple[Counter[float], float, float]:
    """ZeRO-3's all-gathers of `buckets` in forward order, as `passes/zero.py` issues
    them: each bucket where it is first read, and again where it is read after
    ZERO3_REGATHER_AFTER other gathers (a tied head reading the embedding's bucket).
    Counted: how many of each size (parameters), in the order each size first comes,
    and the first and the last gathered."""
    owner = {p: of_segment[i] for i, seg in enumerate(own) for p in seg.segment.owned}
    borrowed = [[b for p in seg.segment.borrowed for b in owner.get(p, [])] for seg in own]
    lent = sorted({b for theirs in borrowed for b in theirs})
    # Where each bucket was last gathered (from 1), kept for those a later read may find
    # gathered: those gathered one by one, those borrowed, and each segment's last,
    # which the next segment may fill on.
    last: dict[int, int] = {}
    counts: Counter[float] = Counter()
    gathered, first, latest = 0, 0.0, 0.0
    for mine, theirs in zip(of_segment, borrowed, strict=True):
        # `mine` is contiguous: the open bucket, then those the segment began, lo to hi.
        lo, hi = (mine[1], mine[-1]) if len(mine) > 1 else (0, -1)
        # Only a borrowing gathers a bucket before the segment that begins it.
        if theirs or len(mine) < 2 or any(lo <= b <= hi and b in last for b in lent):
            order = dict.fromkeys([*mine, *theirs])
        else:
            # Nothing gathered the buckets the segment began: each is gathered once, in
            # order (a 1T model's rank has thousands), after the open one.
            order = dict.fromkeys(mine[:1])
        for b in order:
            if b not in last or gathered - last[b] >= ZERO3_REGATHER_AFTER:
                latest = buckets[b]
                first = latest if not gathered else first
                counts[latest] += 1
                gathered += 1
                last[b] = gathered
        if len(order) < len(mine):
            # Whole buckets but the last, which a later segment may have filled on.
            counts.update(buckets[lo:hi])
            latest = buckets[hi]
            counts[latest] += 1
            first = buckets[lo] if not gathered else first
            last.update((b, gathered + 1 + b - lo) for b in lent if lo <= b <= hi)
            last[hi] = gathered + 1 + hi - lo
            gathered += hi - lo + 1
    return counts, first, latest


@dataclass(frozen=True, slots=True)
class _GatherTally:
    """A rank's ZeRO-3 buckets of one kind (`_Zero3Kind`): how many, and its gathers
    (`_gathers`): how many of each size (parameters), in the order each size first
    comes, and the first and the last."""

    buckets: int
    counts: Counter[float]
    first: float
    last: float

    @property
    def number(self) -> int:
        return self.counts.total()


def _gather_tally(stage: _Stage, kind: _Zero3Kind, models: CostModels) -> _GatherTally:
    """The stage's tally of `kind`, worked out once for the plans `models` price (a 1T
    model's rank has thousands of buckets). The entry keeps its segments, so that their
    ids are not reused while it lives."""
    key = _tally_key(stage, kind)
    own = stage.own
    return models.remember(key, lambda: (tuple(s.segment for s in own), _tally(own, kind)))[1]


def _tally_key(stage: _Stage, kind: _Zero3Kind) -> tuple:
    """What a stage's tally of `kind` depends on. Where none of its segments borrows a
    parameter (a tied weight read far from its owner), only on each segment's
    parameters and whether it is a block (`_buckets_of`, `_gathers`): stages holding
    alike segments share it, as the middle ranks of a deep model's pipelines do
    whatever their cuts. Otherwise the stage's own segments."""
    columns = stage.columns
    if kind.part != "all" or any(s.segment.borrowed for s in stage.own):
        return ("zero3", kind.part, kind.tp, kind.ep, stage.identity)
    blocks = tuple(stage.column(columns.is_block))
    return ("zero3", kind.tp, kind.ep, tuple(stage.column(columns.params)), blocks)


def _tally(own: list[SegmentWork], kind: _Zero3Kind) -> _GatherTally:
    buckets, of_segment = _buckets_of(own, kind.numel)
    return _GatherTally(len(buckets), *_gathers(own, buckets, of_segment))


def _activations(own: list[SegmentWork], choices: Choices) -> Activations:
    """Saved bytes per microbatch at the plan's precision; recomputed blocks keep their
    input, which has the size of their output (the residual stream, as captured); a
    block whose attention core alone is recomputed keeps all but what the core frees,
    which it holds again while that core's backward runs."""
    p = choices.precision
    recomputed = [s for s in own if choices.recomputes(s)]
    selective = [s for s in own if choices.recomputes_attention(s)]
    saved = {id(s): s.saved_bytes(p, choices.compiled) for s in own}
    return Activations(
        kept=sum(saved[id(s)] for s in own if not choices.recomputes(s))
        - sum(s.core_frees_bytes(p) for s in selective),
        recomputed_inputs=sum(s.output_bytes for s in recomputed),
        largest_recomputed=max(
            [saved[id(s)] for s in recomputed] + [s.core_frees_bytes(p) for s in selective],
            default=0.0,
        ),
    )
