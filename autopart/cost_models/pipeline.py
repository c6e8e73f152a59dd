"""Step time of a pipeline, and how much gradient synchronization backward hides.

Pipeline (Huang et al., GPipe, 2019; Narayanan et al., Megatron-LM, 2021). With p
ranks, m microbatches and t_r rank r's time for one microbatch (forward, backward,
recomputation and its own transfers), the slowest rank s works m · t_s; the bubble is
the rest of the step. For balanced ranks GPipe and 1F1B take (m + p − 1) · t, a bubble
fraction (idle / work) of (p − 1)/m (`bubble_fraction`); interleaving v model chunks
per rank cuts the bubble to (p − 1)/v · t, a fraction (p − 1)/(v · m), at the price of
more point-to-point transfers.

Unbalanced ranks do not idle for p − 1 of the slowest rank's microbatches. GPipe and
1F1B are priced as the runtime runs them (`schedule_span`): each rank's forwards and
backwards in the order of torch.distributed.pipelining's schedule, each starting when
the rank is free and its input has come (the previous rank's forward of that
microbatch, the next rank's backward; the last rank's backward follows its own
forward). A 1F1B rank runs p − r warm-up forwards, which fill its wait for the first
backward to come back. Past the first microbatches the span grows by the same amount
for each more (the slowest rank's t_s under 1F1B, the slowest forward plus the slowest
backward under GPipe) once every rank is past its warm-up and a slow rank has spent
the slack the others left it: 2p + 2 microbatches are simulated, the rest
extrapolated at no less than that pace (within a few percent of simulating all).
Interleaved 1F1B keeps the balanced form over the other ranks' chunks:
Σ_{r ≠ s} t_r / v.

Point-to-point transfers (`predict.p2p_comm`). Each chunk sends its activation to the
next chunk, but the last, and its gradient to the one before, but the first. The
runtime's schedules (torch.distributed.pipelining) issue a rank's send in one batch
with the receive it waits for from the same neighbour (1F1B's forward send with the
next backward's receive), so a rank's critical path carries each of its sends, and a
receive is its peer's send: the end ranks of a 1F1B pipeline send once per microbatch,
the others twice.

Gradient synchronization overlaps backward: buckets are reduced while backward goes on
(`runtime.grad_sync`). Every bucket but the last can hide behind backward; the last launches when
backward ends and always shows:

    exposed = max(0, (sync − last bucket) − overlappable backward) + last bucket
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from autopart.policy import Schedule, check_choice

# A microbatch's share of a rank's time in forward, where the caller does not split it:
# backward computes two products for each of forward's.
FORWARD_SHARE = 1 / 3


def bubble_fraction(
    schedule: str | None, stages: int, microbatches: int, virtual_stages: int = 1
) -> float:
    """Idle time over work time: (p − 1)/m for GPipe and 1F1B, (p − 1)/(v·m) for
    interleaved 1F1B; 0 without a pipeline."""
    if stages == 1 or schedule is None:
        return 0.0
    problem = check_choice(Schedule, schedule, "schedule")
    if problem:
        raise ValueError(problem)
    v = virtual_stages if schedule == Schedule.INTERLEAVED_1F1B else 1
    return (stages - 1) / (v * microbatches)


def span_floor(
    schedule: str | None, stages: int, microbatches: int, virtual_stages: int = 1
) -> float:
    """The least span of a step, in units of the ranks' summed time for one
    microbatch, over every way of splitting that time among the ranks: what
    `pipeline_step` can charge at least, whatever the stage cuts.

    GPipe and 1F1B: rank k cannot start before the first microbatch's forwards on the
    ranks before it, nor end before its m microbatches' work, after which the last
    backward still runs on the ranks before it; so the span is at least
    m · t_k + Σ_{i<k} t_i for every k. Over splits with Σ t = W, the least of the
    largest of these is W / (1 − r^p), r = (m − 1)/m, where they are all equal
    (t_k = t_0 · r^k; weighting constraint k by r^(p−1−k) proves no split does better).
    Balanced ranks take (m + p − 1) · W/p, more. Interleaved 1F1B charges
    m · t_s + Σ_{r≠s} t_r / v, least at balanced ranks: (m + (p − 1)/v) · W/p."""
    p, m = stages, microbatches
    if p == 1:
        return m
    if schedule is None:  # the slowest rank's m microbatches, no bubble
        return m / p
    if schedule == Schedule.INTERLEAVED_1F1B:
        return (m + (p - 1) / virtual_stages) / p
    return 1 / (1 - ((m - 1) / m) ** p)


@dataclass(frozen=True, slots=True)
class StepTime:
    """A training step: work, communication on the critical path, pipeline idle."""

    compute: float
    exposed_comm: float
    bubble: float

    @property
    def total(self) -> float:
        return self.compute + self.exposed_comm + self.bubble


def pipeline_step(
    compute: Sequence[float],
    comm: Sequence[float],
    microbatches: int,
    schedule: str | None = None,
    virtual_stages: int = 1,
    forward_share: Sequence[float] | None = None,
) -> StepTime:
    """The step of a pipeline whose rank r spends `compute[r]` computing and `comm[r]`
    communicating (tensor-parallel collectives, stage transfers) per microbatch,
    `forward_share[r]` of it in forward (a third where not given: backward computes
    twice forward's products). The slowest rank sets the pace, m·t of work; the
    bubble is the rest of the schedule's span (module docstring)."""
    times = [c + t for c, t in zip(compute, comm)]
    slowest = max(range(len(times)), key=times.__getitem__)
    work, talk = compute[slowest], comm[slowest]
    bubble = 0.0
    if schedule is not None and bubble_fraction(schedule, len(times), microbatches):
        if schedule == Schedule.INTERLEAVED_1F1B:
            bubble = (sum(times) - times[slowest]) / virtual_stages
        else:
            shares = forward_share or [FORWARD_SHARE] * len(times)
            forward = [t * f for t, f in zip(times, shares)]
            backward = [t - f for t, f in zip(times, forward)]
            span = schedule_span(forward, backward, microbatches, schedule)
            bubble = max(0.0, span - microbatches * times[slowest])
    return StepTime(
        compute=microbatches * work,
        exposed_comm=microbatches * talk,
        bubble=bubble,
    )


def schedule_span(
    forward: Sequence[float], backward: Sequence[float], microbatches: int, schedule: str
) -> float:
    """Seconds from the first forward to the last backward of `microbatches` under
    GPipe or 1F1B, rank r taking `forward[r]` and `backward[r]` for each (module
    docstring): simulated up to 2p + 2 microbatches, extrapolated beyond."""
    simulated = min(microbatches, 2 * len(forward) + 2)
    ranks = (tuple(forward), tuple(backward))
    span = _simulated_span(*ranks, simulated, schedule)
    if simulated == microbatches:
        return span
    pace = (
        max(forward) + max(backward)
        if schedule == Schedule.GPIPE
        else max(f + b for f, b in zip(forward, backward))
    )
    step = span - _simulated_span(*ranks, simulated - 1, schedule)
    return span + (microbatches - simulated) * max(step, pace)


@functools.lru_cache(maxsize=4096)
def _simulated_span(
    forward: tuple[float, ...], backward: tuple[float, ...], microbatches: int, schedule: str
) -> float:
    """The span of the schedule's order on every rank (`_order`), each operation
    starting once its rank is free and its input has come: a forward the rank before's
    forward of its microbatch, a backward the rank after's backward (the last rank's
    its own forward). A rank runs its order as far as its inputs have come; one that
    moves on may unblock its neighbours, visited again, until every rank has run its
    order. The search prices many plans whose ranks take alike times (they differ in
    what the step does once): each is simulated once."""
    p, n = len(forward), 2 * microbatches
    orders = [_order(schedule, r, p, microbatches) for r in range(p)]
    # Per rank, each microbatch's forward and backward end; -1 until it has run.
    forward_end = [[-1.0] * microbatches for _ in range(p)]
    backward_end = [[-1.0] * microbatches for _ in range(p)]
    free = [0.0] * p  # when each rank's last operation ends
    placed = [0] * p
    waiting = list(range(p))  # ranks that may move on: at first all, then a neighbour's
    queued = [True] * p
    while waiting:
        r = waiting.pop()
        queued[r] = False
        order, start, t = orders[r], placed[r], free[r]
        forward_takes, backward_takes = forward[r], backward[r]
        own_forward, own_backward = forward_end[r], backward_end[r]
        before = forward_end[r - 1] if r > 0 else None
        after = backward_end[r + 1] if r < p - 1 else own_forward
        at = start
        while at < n:
            is_forward, k = order[at]
            if is_forward:
                if before is not None:
                    ready = before[k]
                    if ready < 0:
                        break  # its input has not come
                    if ready > t:
                        t = ready
                t += forward_takes
                own_forward[k] = t
            else:
                ready = after[k]
                if ready < 0:
                    break
                if ready > t:
                    t = ready
                t += backward_takes
                own_backward[k] = t
            at += 1
        if at > start:
            placed[r], free[r] = at, t
            for q in (r - 1, r + 1):
                if 0 <= q < p and not queued[q]:
                    queued[q] = True
                    waiting.append(q)
    assert all(at == n for at in placed), "a schedule deadlocked"
    return max(free)


def _order(schedule: str, rank: int, stages: int, microbatches: int) -> list[tuple[bool, int]]:
    """(is forward, microbatch) in the order rank `rank` runs them: GPipe every forward,
    then every backward; 1F1B `stages − rank` warm-up forwards, then one backward and
    one forward in turn, then the remaining backwards (torch.distributed.pipelining's
    ScheduleGPipe and Schedule1F1B)."""
    m = microbatches
    if schedule == Schedule.GPIPE:
        return [(True, k) for k in range(m)] + [(False, k) for k in range(m)]
    warmup = min(m, stages - rank)
    order = [(True, k) for k in range(warmup)]
    for k in range(m):
        order.append((False, k))
        if warmup + k < m:
            order.append((True, warmup + k))
    return order


def exposed_sync(sync: float, overlappable: float, last_bucket: float) -> float:
    """max(0, (sync − last bucket) − overlappable) + last bucket, where `sync` is the
    time of every bucket, the last included."""
    return max(0.0, sync - last_bucket - overlappable) + last_bucket


def bucket_sizes(
    total_bytes: float, bucket_bytes: float, first_bytes: float | None = None
) -> list[float]:
    """`total_bytes` of gradients cut as the runtime cuts them: a first bucket of at most
    `first_bytes` (the first gradients of backward), then buckets of `bucket_bytes`."""
    return [
        size
        for size, count in bucket_runs(total_bytes, bucket_bytes, first_bytes)
        for _ in range(count)
    ]


def bucket_runs(
    total_bytes: float, bucket_bytes: float, first_bytes: float | None = None
) -> list[tuple[float, int]]:
    """`bucket_sizes` as (size, how many) runs, in order: a 1T model's gradients are
    thousands of buckets, and the search prices them for every plan."""
    if total_bytes <= 0:
        return []
    first = min(total_bytes, first_bytes or bucket_bytes)
    full, rest = divmod(total_bytes - first, bucket_bytes)
    runs = [(first, 1), (bucket_bytes, int(full)), (rest, 1)]
    return [(size, count) for size, count in runs if count and size]
