"""What a plan will cost: step time with its parts, peak memory with its parts, model
FLOP/s per device, from an analyzed graph, a mesh and the plan's choices.

Per microbatch of global_batch / (dp · m) rows, every segment of the graph is priced by
the compute model (forward, backward, recomputation) on this rank's tensor-parallel
share. Segments go to pipeline chunks (the plan's stage cuts, or an even split by
blocks) and chunks to pipeline ranks; then per rank:

  communication on the critical path, per microbatch:
    tensor parallelism (Megatron-LM): each block all-reduces its output activation
      twice in forward (after attention and after the MLP) and twice in backward (their
      input gradients), twice more when recomputed, over the tp axis (stride 1). This
      assumes transformer blocks (one attention and one MLP each); with sequence
      parallelism each all-reduce becomes a reduce-scatter plus an all-gather of the
      same total volume;
    pipeline transfers: one activation sent forward and one gradient sent backward per
      chunk, over the pp axis (stride dp·tp);
    ZeRO-3: every microbatch gathers the rank's parameters in forward and again in
      backward, and reduce-scatters its gradients; the gathers hide behind forward and
      backward compute, the first block's gather and the last bucket do not;
  gradient synchronization over dp (stride tp), once per step after the last
    microbatch: bucketed all-reduce (ZeRO-0) or reduce-scatter (ZeRO-1/2), hidden behind
    the last microbatch's backward but for its last bucket (`pipeline.exposed_sync`);
    ZeRO-1/2 then all-gather the updated parameters, fully exposed;
  the optimizer step (memory-bound, `ComputeModel.optimizer_step_time`).

The pipeline formula (`pipeline.pipeline_step`) turns per-microbatch times into the
step; the largest rank's memory is the plan's peak. Model FLOP/s count forward and
backward (3× forward FLOPs) without recomputation, as in MFU (Chowdhery et al., PaLM).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import fx

from autopart.cost_models.comm import (
    ALL_GATHER,
    ALL_REDUCE,
    REDUCE_SCATTER,
    SEND_RECV,
    CommModel,
)
from autopart.cost_models.compute import ComputeModel, PhaseCost
from autopart.cost_models.memory import (
    STATE_BYTES,
    Activations,
    MemoryModel,
    in_flight_microbatches,
    total,
)
from autopart.cost_models.pipeline import SCHEDULES, bucket_sizes, exposed_sync, pipeline_step
from autopart.cost_models.stages import balanced_chunks, chunks_at_cuts
from autopart.cost_models.summary import BATCH, GraphSummary, SegmentWork
from autopart.mesh import Mesh
from autopart.plan import Plan, Predicted

TP_ALL_REDUCES_FORWARD = 2  # per block: after attention, after the MLP
TP_ALL_REDUCES_BACKWARD = 2


@dataclass(frozen=True, slots=True)
class Choices:
    """What a plan decides that the costs depend on (the fields of `Plan`)."""

    global_batch: int
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    microbatches: int = 1
    schedule: str | None = None
    virtual_stages: int = 1
    precision: str = "fp32"
    recompute: tuple[str, ...] = ()  # module paths of recomputed blocks (or containers)
    stage_cuts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.pp > 1 and self.schedule is None:
            raise ValueError("a pipeline (pp > 1) needs a schedule: one of " + ", ".join(SCHEDULES))

    @classmethod
    def of(cls, plan: Plan) -> Choices:
        return cls(
            plan.global_batch, plan.dp, plan.tp, plan.pp, plan.zero, plan.microbatches,
            plan.schedule, plan.virtual_stages, plan.precision, plan.recompute, plan.stage_cuts,
        )

    @property
    def microbatch_size(self) -> int:
        parts = self.dp * self.microbatches
        if self.global_batch % parts:
            raise ValueError(
                f"the global batch of {self.global_batch} does not split into "
                f"dp={self.dp} × microbatches={self.microbatches} equal parts"
            )
        return self.global_batch // parts

    @property
    def chunks(self) -> int:
        return self.pp * self.virtual_stages

    def recomputes(self, segment: SegmentWork) -> bool:
        return segment.is_block and any(
            segment.key == r or segment.key.startswith(r + ".") for r in self.recompute
        )


@dataclass(frozen=True, slots=True)
class CostModels:
    """The models a prediction uses, passed explicitly."""

    compute: ComputeModel
    comm: CommModel
    memory: MemoryModel

    @classmethod
    def of(cls, mesh: Mesh, precision: str) -> CostModels:
        compute = ComputeModel(mesh.device, precision, half_dim=mesh.device.matmul_half_dim)
        return cls(compute, CommModel(mesh), MemoryModel(precision))


@dataclass(frozen=True, slots=True)
class RankCost:
    """One pipeline rank: per-microbatch compute and critical-path communication, the
    once-per-step parts, and its memory."""

    compute: PhaseCost
    comm: float
    sync: float
    optimizer: float
    memory: dict[str, int]


def predict(
    graph: fx.GraphModule | GraphSummary,
    mesh: Mesh,
    choices: Choices,
    dims: Mapping[str, int] | None = None,
    models: CostModels | None = None,
) -> Predicted:
    """The plan's step time (compute, exposed communication, bubble), the largest rank's
    memory by part, and model FLOP/s per device. `graph` is an analyzed graph (or its
    summary, to price many plans of one graph); `dims` gives the sizes of named dims
    other than the batch (`{"seq": 2048}` when the sequence is dynamic)."""
    summary = graph if isinstance(graph, GraphSummary) else GraphSummary(graph)
    mesh.check_factorization(choices.dp, choices.tp, choices.pp)
    models = models or CostModels.of(mesh, choices.precision)
    full = summary.evaluate({**(dims or {}), BATCH: choices.microbatch_size})
    segments = [s.sharded(choices.tp) for s in full]
    times = _segment_times(segments, choices, models.compute)
    chunk_of = (
        chunks_at_cuts(segments, choices.stage_cuts) if choices.stage_cuts
        else balanced_chunks(segments, [t.total for t in times], choices.chunks)
    )
    ranks = [
        _rank_cost(r, [i for i, c in enumerate(chunk_of) if c % choices.pp == r],
                   segments, times, choices, models)
        for r in range(choices.pp)
    ]
    step = pipeline_step(
        [r.compute.total for r in ranks], [r.comm for r in ranks],
        choices.microbatches, choices.schedule, choices.virtual_stages,
    )
    optimizer = max(r.optimizer for r in ranks)
    sync = max(r.sync for r in ranks)
    step_time = step.total + optimizer + sync
    peak = max(ranks, key=lambda r: total(r.memory)).memory
    model_flops = 3 * sum(s.flops for s in full) * choices.microbatches * choices.dp
    return Predicted(
        step_time_s=step_time,
        compute_s=step.compute + optimizer,
        exposed_comm_s=step.exposed_comm + sync,
        bubble_s=step.bubble,
        peak_memory_bytes=total(peak),
        memory=peak,
        model_flops_per_device=model_flops / mesh.world_size / step_time,
    )


def _segment_times(
    segments: list[SegmentWork], choices: Choices, compute: ComputeModel
) -> list[PhaseCost]:
    """Each segment's seconds per microbatch; one block instance priced per block."""
    cache: dict[tuple[str, bool], PhaseCost] = {}
    out = []
    for seg in segments:
        recompute = choices.recomputes(seg)
        key = (seg.segment.block_id or f"segment {len(out)}", recompute)
        if key not in cache:
            cache[key] = compute.cost(seg.nodes, recompute)
        out.append(cache[key])
    return out


def _rank_cost(
    rank: int,
    mine: list[int],
    segments: list[SegmentWork],
    times: list[PhaseCost],
    choices: Choices,
    models: CostModels,
) -> RankCost:
    own = [segments[i] for i in mine]
    compute = sum((times[i] for i in mine), PhaseCost())
    params = sum(s.param_numel(choices.tp) for s in own)
    boundary = max((s.output_bytes for s in own if s.is_block), default=0.0)
    blocks = [s for s in own if s.is_block]
    gathered = max((s.param_numel(choices.tp) for s in blocks), default=params)
    comm = (
        _tp_comm(own, choices, models.comm)
        + _p2p_comm(boundary, choices, models.comm)
        + _zero3_comm(params, gathered, compute, choices, models)
    )
    in_flight = in_flight_microbatches(
        choices.schedule, choices.microbatches, choices.pp, rank, choices.virtual_stages
    )
    memory = models.memory.breakdown(
        params, choices.dp, choices.zero,
        activations=_activations(own, choices).bytes(in_flight),
        gathered_params=gathered,
        pipeline_bytes=boundary if choices.pp > 1 else 0.0,
    )
    return RankCost(
        compute=compute,
        comm=comm,
        sync=_dp_sync(params, compute, choices, models),
        optimizer=_optimizer_time(params, choices, models.compute),
        memory=memory,
    )


def _tp_comm(own: list[SegmentWork], choices: Choices, comm: CommModel) -> float:
    """Per microbatch: 2 forward + 2 backward (+ 2 recomputed) all-reduces over tp of a
    block's output, as a row-parallel matmul produces it (16-bit under mixed
    precision)."""
    if choices.tp == 1:
        return 0.0
    scale = 1.0 if choices.precision == "fp32" else 0.5
    seconds = 0.0
    for seg in own:
        if seg.is_block:
            count = TP_ALL_REDUCES_FORWARD * (1 + choices.recomputes(seg)) + TP_ALL_REDUCES_BACKWARD
            seconds += count * comm.time(ALL_REDUCE, seg.output_bytes * scale, choices.tp)
    return seconds


def _p2p_comm(boundary: float, choices: Choices, comm: CommModel) -> float:
    """Per microbatch: one activation and one gradient per chunk of this rank."""
    if choices.pp == 1:
        return 0.0
    one = comm.time(SEND_RECV, boundary, choices.pp, stride=choices.dp * choices.tp)
    return 2 * choices.virtual_stages * one


def _zero3_comm(
    params: float, gathered: float, compute: PhaseCost, choices: Choices, models: CostModels
) -> float:
    """Per microbatch under ZeRO-3: the gathers and reduce-scatter beyond what forward
    and backward hide, plus the first block's gather and the last bucket."""
    if choices.zero != 3 or choices.dp == 1:
        return 0.0
    param_bytes, grad_bytes = STATE_BYTES[choices.precision][:2]
    comm, stride = models.comm, choices.tp
    gather = comm.time(ALL_GATHER, params * param_bytes, choices.dp, stride)
    first = comm.time(ALL_GATHER, gathered * param_bytes, choices.dp, stride)
    scatter, last = _bucketed(REDUCE_SCATTER, params * grad_bytes, choices, models)
    backward = compute.backward + compute.recompute
    return first + max(0.0, gather - compute.forward) + exposed_sync(
        gather + scatter, backward, last
    )


def _dp_sync(params: float, compute: PhaseCost, choices: Choices, models: CostModels) -> float:
    """Once per step: ZeRO-0/1/2 gradient reduction, hidden behind the last microbatch's
    backward but for its last bucket; ZeRO-1/2's parameter all-gather after the step."""
    if choices.dp == 1 or choices.zero == 3:
        return 0.0
    param_bytes, grad_bytes = STATE_BYTES[choices.precision][:2]
    op = ALL_REDUCE if choices.zero == 0 else REDUCE_SCATTER
    sync, last = _bucketed(op, params * grad_bytes, choices, models)
    exposed = exposed_sync(sync, compute.backward + compute.recompute, last)
    if choices.zero == 0:
        return exposed
    return exposed + models.comm.time(ALL_GATHER, params * param_bytes, choices.dp, choices.tp)


def _bucketed(
    op: str, nbytes: float, choices: Choices, models: CostModels
) -> tuple[float, float]:
    """(every bucket, the last bucket): seconds of `op` over dp on `nbytes` of gradients
    cut into the memory model's buckets."""
    sizes = bucket_sizes(nbytes, models.memory.bucket_bytes)
    seconds = {b: models.comm.time(op, b, choices.dp, choices.tp) for b in set(sizes)}
    return sum(seconds[b] for b in sizes), seconds[sizes[-1]] if sizes else 0.0


def _optimizer_time(params: float, choices: Choices, compute: ComputeModel) -> float:
    """Adam touches this rank's parameters, gradients and state: all of them, or 1/dp
    of them under ZeRO."""
    shard = params / (choices.dp if choices.zero >= 1 else 1)
    return compute.optimizer_step_time(shard * sum(STATE_BYTES[choices.precision]))


def _activations(own: list[SegmentWork], choices: Choices) -> Activations:
    """Saved bytes per microbatch at the plan's precision; recomputed blocks keep their
    input, which has the size of their output (the residual stream, as captured)."""
    recomputed = [s for s in own if choices.recomputes(s)]
    saved = {id(s): s.saved_bytes(choices.precision) for s in own}
    return Activations(
        kept=sum(saved[id(s)] for s in own if not choices.recomputes(s)),
        recomputed_inputs=sum(s.output_bytes for s in recomputed),
        largest_recomputed=max((saved[id(s)] for s in recomputed), default=0.0),
    )
