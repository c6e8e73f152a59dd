"""The collectives a plan's step runs, with their bytes and axis, from the plan alone.

A saved plan holds predictions, not the graph, so the traffic is recovered from what
the cost models recorded, with the cost models' own rules (`cost_models.predict`,
`cost_models.memory`), for the rank whose memory breakdown the plan keeps (the one with
the largest peak):

    its parameters     the breakdown's "parameters" over the bytes per parameter
                       (times dp, or dp × ep, under ZeRO-3, which shards them)
    dp gradient sync   ZeRO-0 all-reduces the gradients once per step; ZeRO-1/2
                       reduce-scatter them and all-gather the updated parameters;
                       ZeRO-3 gathers the parameters in forward and again in backward and
                       reduce-scatters the gradients, every microbatch
    pp transfers       one activation forward and one gradient backward per chunk and
                       microbatch; the activation's size is the breakdown's "buffers"
                       less what ZeRO stages there (`MemoryModel.buffer_bytes`), halved
                       (a rank holds one activation to send and one received). Under
                       ZeRO-3 the buffers also hold gathered blocks of unrecorded size,
                       so the transfer's bytes are unknown
    tp collectives     the plan records each resharding site's collective, calls, bytes
                       and seconds per step over the pipeline's stages
                       (`Predicted.resharding`, as `explain()` lists them): summed by
                       collective and direction. A plan without them: each rank's
                       time alone (`StageFigures.tp_comm_s`)
    ep all_to_alls     likewise (`StageFigures.ep_comm_s`): time only. Under ep the
                       gradient sync spans dp × ep (the experts' own spans dp alone;
                       the plan does not record their share, so all is timed over dp × ep)
    the step's sums    the loss, the gradient norm's parts and the inputs' checksums:
                       one all-reduce of a few values over the world per step

Times come from the communication model on the plan's mesh: each collective's transfer
time per step, before any overlap with compute hides it.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopart.cost_models.comm import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    REDUCE_SCATTER,
    SEND_RECV,
    CommModel,
)
from autopart.cost_models.memory import MemoryModel, state_bytes
from autopart.cost_models.pipeline import bucket_runs
from autopart.cost_models.predict import STEP_SUMS_BYTES
from autopart.degrees import Axis, MeshError
from autopart.mesh import Mesh
from autopart.plan import Plan, Predicted


@dataclass(frozen=True, slots=True)
class Collective:
    """One kind of collective in a step, on one rank. `nbytes` is the buffer bytes it
    moves per step (summed over its calls), None where the plan does not hold them;
    `seconds` its modeled transfer time per step, None where the mesh's device is
    unknown here."""

    name: str
    op: str
    axis: str
    group: int
    calls: int | None  # None: not recorded
    nbytes: float | None
    seconds: float | None
    note: str = ""


def step_collectives(plan: Plan) -> list[Collective]:
    """Every collective of the plan's step that moves data (module docstring)."""
    predicted = _predicted(plan)
    comm = _comm_model(plan)
    params = _parameters(plan, predicted)
    found = [
        *_dp_sync(plan, params, comm),
        *_pp_transfers(plan, predicted, params, comm),
        *_tp_collectives(plan, predicted),
        *_ep_collectives(plan, predicted),
    ]
    if plan.mesh.world_size > 1:
        world = plan.mesh.world_size
        seconds = comm.time(ALL_REDUCE, STEP_SUMS_BYTES, world) if comm else None
        found.append(
            Collective(
                "step sums (loss, gradient norm, input checksums)",
                ALL_REDUCE,
                "world",
                world,
                1,
                STEP_SUMS_BYTES,
                seconds,
            )
        )
    return found


def recorded_rank(predicted: Predicted) -> int:
    """The pipeline rank whose memory breakdown the plan keeps: the first with the
    largest peak, as the cost models choose it."""
    peaks = [s.peak_memory_bytes for s in predicted.stages]
    return peaks.index(predicted.peak_memory_bytes) if predicted.peak_memory_bytes in peaks else 0


def _predicted(plan: Plan) -> Predicted:
    if plan.predicted is None:
        raise ValueError("the plan carries no predictions: make it with autopart.plan()")
    return plan.predicted


def _comm_model(plan: Plan) -> CommModel | None:
    """The communication model of the plan's mesh; None where its device is a profile
    this machine does not have."""
    try:
        mesh = Mesh.cluster(plan.mesh.device, plan.mesh.nodes, plan.mesh.per_node)
    except MeshError:
        return None
    return CommModel(mesh)


def _parameters(plan: Plan, predicted: Predicted) -> float:
    """Parameters on the recorded rank: its tensor-parallel share of its stage's."""
    param_bytes = state_bytes(plan.precision, plan.master_weights)[0]
    sharded = plan.degrees.batch_split if plan.zero == 3 else 1
    return predicted.memory.get("parameters", 0) * sharded / param_bytes


def _time(comm: CommModel | None, op: str, nbytes: float, plan: Plan, axis: Axis) -> float | None:
    if comm is None:
        return None
    if axis == Axis.DP and plan.ep > 1:  # the batch's ranks: dp × ep
        return comm.time(op, nbytes, plan.degrees.batch_split, plan.degrees.stride(Axis.EP))
    return comm.time(op, nbytes, plan.degrees[axis], plan.degrees.stride(axis))


def _bucketed_time(
    comm: CommModel | None, op: str, nbytes: float, plan: Plan
) -> tuple[int, float | None]:
    """(calls, seconds) of `op` over dp on `nbytes` (gradients, or the updated
    parameters gathered back) cut into the runtime's buckets, as the cost models price
    it."""
    memory = MemoryModel(plan.precision)
    runs = bucket_runs(nbytes, memory.bucket_bytes, memory.first_bucket_bytes)
    calls = sum(n for _, n in runs)
    if comm is None:
        return calls, None
    seconds = sum(n * (_time(comm, op, size, plan, Axis.DP) or 0.0) for size, n in runs)
    return calls, seconds


def _dp_sync(plan: Plan, params: float, comm: CommModel | None) -> list[Collective]:
    if plan.degrees.batch_split == 1:
        return []
    param_bytes, grad_bytes = state_bytes(plan.precision, plan.master_weights)[:2]
    grads, weights = params * grad_bytes, params * param_bytes
    axis, ranks = ("dp×ep", plan.degrees.batch_split) if plan.ep > 1 else ("dp", plan.dp)
    if plan.zero == 3:
        m = plan.microbatches
        gather = _time(comm, ALL_GATHER, weights, plan, Axis.DP)
        scatter = _time(comm, REDUCE_SCATTER, grads, plan, Axis.DP)
        note = (
            "every microbatch, in buckets (timed as one buffer); a tied weight gathered "
            "again is not counted"
        )
        return [
            Collective(
                "ZeRO-3 parameter gather",
                ALL_GATHER,
                axis,
                ranks,
                2 * m,
                2 * m * weights,
                _scaled(gather, 2 * m),
                note,
            ),
            Collective(
                "ZeRO-3 gradient reduce-scatter",
                REDUCE_SCATTER,
                axis,
                ranks,
                m,
                m * grads,
                _scaled(scatter, m),
                note,
            ),
        ]
    op = ALL_REDUCE if plan.zero == 0 else REDUCE_SCATTER
    calls, seconds = _bucketed_time(comm, op, grads, plan)
    note = "bucketed" + (
        f"; before {plan.grad_compression} compression (the step's prediction prices it)"
        if plan.grad_compression
        else ""
    )
    out = [Collective("gradient sync", op, axis, ranks, calls, grads, seconds, note)]
    if plan.zero in (1, 2):
        gathers, gather = _bucketed_time(comm, ALL_GATHER, weights, plan)
        out.append(
            Collective(
                "updated parameter gather", ALL_GATHER, axis, ranks, gathers, weights, gather
            )
        )
    return out


def _ep_collectives(plan: Plan, predicted: Predicted) -> list[Collective]:
    """Time only: the plan holds each rank's expert all_to_alls' seconds per step."""
    if plan.ep == 1:
        return []
    note = "time only: the plan records their seconds; 4 per routed layer and microbatch"
    return [
        Collective(
            f"expert all_to_alls, pipeline rank {r}",
            ALL_TO_ALL,
            "ep",
            plan.ep,
            None,
            None,
            stage.ep_comm_s,
            note,
        )
        for r, stage in enumerate(predicted.stages)
    ]


def _scaled(seconds: float | None, factor: float) -> float | None:
    return None if seconds is None else seconds * factor


def _pp_transfers(
    plan: Plan, predicted: Predicted, params: float, comm: CommModel | None
) -> list[Collective]:
    """Stage-to-stage sends of activations and their gradients."""
    if plan.pp == 1:
        return []
    calls = 2 * plan.microbatches * plan.virtual_stages
    name = "stage transfers (activation, gradient)"
    if plan.zero == 3:
        note = "the plan does not record the activation's size under ZeRO-3"
        return [Collective(name, SEND_RECV, "pp", plan.pp, calls, None, None, note)]
    per_param = state_bytes(plan.precision, plan.master_weights)
    staged = MemoryModel(plan.precision).buffer_bytes(
        params, plan.dp, plan.zero, 0.0, 0.0, per_param
    )
    activation = max(0.0, predicted.memory.get("buffers", 0) - staged) / 2
    one = _time(comm, SEND_RECV, activation, plan, Axis.PP)
    return [
        Collective(
            name,
            SEND_RECV,
            "pp",
            plan.pp,
            calls,
            calls * activation,
            _scaled(one, calls),
            f"{activation:.0f} bytes each",
        )
    ]


def _tp_collectives(plan: Plan, predicted: Predicted) -> list[Collective]:
    """The resharding sites the plan records (`Predicted.resharding`, what `explain()`
    lists), summed by collective and direction over the pipeline's stages: their calls,
    bytes and seconds per step. A plan saved without them: each rank's seconds alone."""
    if plan.tp == 1:
        return []
    if predicted.resharding:
        summed: dict[tuple[str, bool], list[float]] = {}
        sites: dict[tuple[str, bool], int] = {}
        for r in predicted.resharding:
            key = (r.collective, r.backward)
            calls, nbytes, seconds = summed.setdefault(key, [0, 0.0, 0.0])
            summed[key] = [calls + r.count, nbytes + r.count * r.bytes_each, seconds + r.seconds]
            sites[key] = sites.get(key, 0) + 1
        over = f" over the {plan.pp} pipeline ranks" if plan.pp > 1 else ""
        return [
            Collective(
                f"tensor-parallel {op.replace('_', '-')} ({'backward' if backward else 'forward'})",
                op,
                "tp",
                plan.tp,
                int(calls),
                nbytes,
                seconds,
                f"{sites[(op, backward)]} resharding site(s){over}; each in explain()",
            )
            for (op, backward), (calls, nbytes, seconds) in summed.items()
        ]
    note = "time only: this plan records their seconds, not their sites"
    return [
        Collective(
            f"tensor-parallel collectives, pipeline rank {r}",
            "layout's",
            "tp",
            plan.tp,
            None,
            None,
            stage.tp_comm_s,
            note,
        )
        for r, stage in enumerate(predicted.stages)
    ]
