"""Step time of a pipeline, and how much gradient synchronization backward hides.

Pipeline (Huang et al., GPipe, 2019; Narayanan et al., Megatron-LM, 2021). With p
stages, m microbatches and t the slowest rank's time for one microbatch (forward,
backward, recomputation and its own transfers), GPipe and 1F1B take

    step = (m + p − 1) · t

of which m · t is work and (p − 1) · t the bubble: a bubble fraction (idle / work) of
(p − 1)/m. Interleaving v model chunks per rank cuts the bubble to (p − 1)/v · t, a
fraction (p − 1)/(v · m), at the price of v times more point-to-point transfers.

Point-to-point transfers. Each microbatch crosses each stage boundary twice (its
activation forward, its gradient backward); a rank pays one send of each per chunk it
holds, on its critical path.

Gradient synchronization overlaps backward: buckets are reduced while backward goes on
(`runtime.grad_sync`). Every bucket but the last can hide behind backward; the last launches when
backward ends and always shows:

    exposed = max(0, (sync − last bucket) − overlappable backward) + last bucket
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autopart.policy import Schedule, check_choice


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
) -> StepTime:
    """The step of a pipeline whose rank r spends `compute[r]` computing and `comm[r]`
    communicating (tensor-parallel collectives, stage transfers) per microbatch. The
    slowest rank sets the pace: m·t of work and bubble_fraction·m·t of idle time."""
    slowest = max(range(len(compute)), key=lambda r: compute[r] + comm[r])
    work, talk = compute[slowest], comm[slowest]
    fraction = bubble_fraction(schedule, len(compute), microbatches, virtual_stages)
    return StepTime(
        compute=microbatches * work,
        exposed_comm=microbatches * talk,
        bubble=fraction * microbatches * (work + talk),
    )


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
