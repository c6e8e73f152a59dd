"""The pipeline schedule as a timeline: which rank runs what, when.

The cost models price a pipeline with a closed formula (`cost_models.pipeline`); a
reader understands the bubble better by seeing it. This module replays the plan's
schedule on per-stage durations and returns, per rank, the slots it computes and the
gaps it waits in.

The replay is a list schedule. Every rank runs its own operations in the order the
schedule gives it (`rank_orders`); an operation starts when its rank is free and its
dependencies are done:

    forward  F(c, m) after F(c − 1, m)              (the activation from the chunk before)
    backward B(c, m) after B(c + 1, m), or after F(c, m) on the last chunk

where c is a model chunk (a stage; rank c mod p holds chunk c) and m a microbatch.
Transfers are not drawn: the plan's per-microbatch times already include them.

Orders, per rank r of p, with m microbatches:

    gpipe             every forward, then every backward
    1f1b              min(p − 1 − r, m) forwards (warm-up), then one forward and one
                      backward in turn, then the backwards left (cool-down)
    interleaved-1f1b  as 1f1b over the rank's v chunks (Megatron-LM's order): forwards
                      go in groups of p microbatches through chunk 0, 1, ..., v − 1,
                      backwards through the chunks in reverse; the warm-up is
                      min(2(p − 1 − r) + (v − 1)·p, m·v) chunk-forwards
    None (pp = 1)     forward and backward of each microbatch in turn (accumulation)

Durations (`stage_durations`): the plan records each stage's time per microbatch, not
its split, so forward is taken as 1/3 and backward 2/3 of it (backward computes two
matmuls per forward one), after recomputation (the stage's recompute_s / m, run just
before each backward) is set apart. A rank holding v chunks spends 1/v of each on a chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from autopart.plan import Plan
from autopart.policy import Schedule

FORWARD = "forward"
BACKWARD = "backward"
RECOMPUTE = "recompute"
IDLE = "idle"
FORWARD_SHARE = 1 / 3  # of a microbatch's compute; backward takes the rest


class Slot(NamedTuple):
    """One stretch of a rank's time; `microbatch` is -1 for idle gaps."""

    start: float
    end: float
    kind: str
    microbatch: int
    chunk: int = 0


@dataclass(frozen=True, slots=True)
class StageDurations:
    """Seconds one rank spends per microbatch on its whole share of the model."""

    forward: float
    backward: float
    recompute: float = 0.0


class Op(NamedTuple):
    """One operation a rank runs: forward or backward of a microbatch on a chunk."""

    kind: str
    chunk: int
    microbatch: int


def stage_durations(plan: Plan) -> list[StageDurations]:
    """Each pipeline rank's forward, backward and recompute seconds per microbatch,
    from the plan's predictions (see the module docstring for the 1/3 : 2/3 split)."""
    if plan.predicted is None or not plan.predicted.stages:
        raise ValueError("the plan carries no per-stage predictions to draw a timeline from")
    out = []
    for stage in plan.predicted.stages:
        recompute = stage.recompute_s / plan.microbatches
        work = max(0.0, stage.microbatch_s - recompute)
        out.append(StageDurations(work * FORWARD_SHARE, work * (1 - FORWARD_SHARE), recompute))
    return out


def simulate(
    stages: Sequence[StageDurations],
    microbatches: int,
    schedule: str | None,
    virtual_stages: int = 1,
) -> list[list[Slot]]:
    """Per rank, its slots from time 0 to the end of the step (the last rank to finish),
    idle gaps included, in time order."""
    p, v = len(stages), _chunks_per_rank(schedule, virtual_stages)
    orders = rank_orders(p, microbatches, schedule, v)
    done = _replay(orders, stages, v)
    step = max((end for _, end in done.values()), default=0.0)
    return [_timeline(order, done, stages[r], v, step) for r, order in enumerate(orders)]


def _chunks_per_rank(schedule: str | None, virtual_stages: int) -> int:
    return virtual_stages if schedule == Schedule.INTERLEAVED_1F1B else 1


def rank_orders(p: int, m: int, schedule: str | None, v: int = 1) -> list[list[Op]]:
    """The order in which each of p ranks runs its operations (module docstring)."""
    if schedule == Schedule.GPIPE:
        return [_gpipe(r, m) for r in range(p)]
    if schedule in (None, Schedule.ONE_F_ONE_B):
        v, warmup = 1, [p - 1 - r for r in range(p)]
    elif schedule == Schedule.INTERLEAVED_1F1B:
        # As torch's ScheduleInterleaved1F1B: m // p rounds (at least one) of equal size.
        rounds = max(1, m // p)
        if m % rounds:
            raise ValueError(f"interleaved 1F1B runs {m} microbatches in {rounds} equal rounds")
        size = m // rounds
        warmup = [2 * (p - 1 - r) + (v - 1) * size for r in range(p)]
        return [
            _one_f_one_b(_forwards(r, p, m, v, size), _backwards(r, p, m, v, size), warmup[r])
            for r in range(p)
        ]
    else:
        raise ValueError(f"unknown schedule {schedule!r}")
    return [
        _one_f_one_b(_forwards(r, p, m, v), _backwards(r, p, m, v), warmup[r]) for r in range(p)
    ]


def _gpipe(rank: int, m: int) -> list[Op]:
    return [Op(FORWARD, rank, i) for i in range(m)] + [Op(BACKWARD, rank, i) for i in range(m)]


def _forwards(rank: int, p: int, m: int, v: int, size: int | None = None) -> list[Op]:
    """Rounds of `size` microbatches (p by default), each through the rank's chunks in
    model order."""
    size = size or p
    return [
        Op(FORWARD, j * p + rank, mb)
        for group in range(0, m, size)
        for j in range(v)
        for mb in range(group, min(group + size, m))
    ]


def _backwards(rank: int, p: int, m: int, v: int, size: int | None = None) -> list[Op]:
    """As `_forwards`, through the chunks in reverse."""
    size = size or p
    return [
        Op(BACKWARD, j * p + rank, mb)
        for group in range(0, m, size)
        for j in reversed(range(v))
        for mb in range(group, min(group + size, m))
    ]


def _one_f_one_b(forwards: list[Op], backwards: list[Op], warmup: int) -> list[Op]:
    """`warmup` forwards, then a forward and a backward in turn, then the rest."""
    w = max(0, min(warmup, len(forwards)))
    order = forwards[:w]
    for i, forward in enumerate(forwards[w:]):
        order += [forward, backwards[i]]
    return order + backwards[len(forwards) - w :]


def _dependency(op: Op, chunks: int) -> Op | None:
    """The operation whose end `op` waits for on another chunk (or its own forward)."""
    if op.kind == FORWARD:
        return Op(FORWARD, op.chunk - 1, op.microbatch) if op.chunk > 0 else None
    if op.chunk == chunks - 1:
        return Op(FORWARD, op.chunk, op.microbatch)
    return Op(BACKWARD, op.chunk + 1, op.microbatch)


def _duration(op: Op, stage: StageDurations, v: int) -> float:
    if op.kind == FORWARD:
        return stage.forward / v
    return (stage.recompute + stage.backward) / v


def _replay(
    orders: list[list[Op]], stages: Sequence[StageDurations], v: int
) -> dict[Op, tuple[float, float]]:
    """(start, end) of every operation: each rank takes its next operation as soon as
    that operation's dependency is done; an order that waits on itself is an error."""
    chunks = len(orders) * v
    done: dict[Op, tuple[float, float]] = {}
    free = [0.0] * len(orders)
    nxt = [0] * len(orders)
    progress = True
    while progress:
        progress = False
        for r, order in enumerate(orders):
            while nxt[r] < len(order):
                op = order[nxt[r]]
                dep = _dependency(op, chunks)
                if dep is not None and dep not in done:
                    break
                start = max(free[r], done[dep][1] if dep is not None else 0.0)
                free[r] = start + _duration(op, stages[r], v)
                done[op] = (start, free[r])
                nxt[r] += 1
                progress = True
    if any(n < len(order) for n, order in zip(nxt, orders)):
        raise ValueError("the schedule's orders wait on each other: no timeline")
    return done


def _timeline(
    order: list[Op],
    done: dict[Op, tuple[float, float]],
    stage: StageDurations,
    v: int,
    step: float,
) -> list[Slot]:
    """A rank's operations as slots (recomputation split from backward), gaps as idle."""
    slots: list[Slot] = []
    clock = 0.0
    for op in order:
        start, end = done[op]
        if start > clock:
            slots.append(Slot(clock, start, IDLE, -1))
        recompute = stage.recompute / v if op.kind == BACKWARD else 0.0
        if recompute > 0:
            slots.append(Slot(start, start + recompute, RECOMPUTE, op.microbatch, op.chunk))
        slots.append(Slot(start + recompute, end, op.kind, op.microbatch, op.chunk))
        clock = end
    if step > clock:
        slots.append(Slot(clock, step, IDLE, -1))
    return slots


def idle_fraction(timeline: list[list[Slot]]) -> float:
    """Idle time over all ranks' time from 0 to the end of the step: the bubble."""
    span = sum(s.end - s.start for rank in timeline for s in rank)
    idle = sum(s.end - s.start for rank in timeline for s in rank if s.kind == IDLE)
    return idle / span if span else 0.0


def plan_timeline(plan: Plan) -> list[list[Slot]]:
    """The plan's schedule replayed on its predicted stage times."""
    return simulate(stage_durations(plan), plan.microbatches, plan.schedule, plan.virtual_stages)
