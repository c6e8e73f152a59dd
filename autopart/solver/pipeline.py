"""The pipeline's shape for pp > 1: schedule, virtual stages, microbatches and cuts.

Unpinned, a pipeline runs 1F1B (interleaved 1F1B with virtual stages) over the fewest
microbatches that keep every stage busy in the steady state: the smallest divisor of the
per-replica batch that is at least pp. The checks are the schedules' own requirements,
made here so that a plan that validates also runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from autopart.plan import PlanError
from autopart.policy import Schedule
from autopart.solver.stages import choose_stage_cuts


@dataclass(frozen=True, slots=True)
class PipelineChoice:
    schedule: str | None
    virtual_stages: int
    microbatches: int
    stage_cuts: tuple[str, ...]


def choose_pipeline(
    gm: fx.GraphModule,
    pp: int,
    replica_batch: int,
    schedule: str | None,
    virtual_stages: int | None,
    microbatches: int | None,
    stage_cuts: tuple[str, ...] = (),
) -> PipelineChoice:
    """`replica_batch` is the global batch over dp; the other arguments are pins, or the
    search's choices (its stage cuts); without cuts they are balanced in FLOPs."""
    if pp == 1:
        return PipelineChoice(schedule, virtual_stages or 1, microbatches or 1, ())
    virtual = virtual_stages or (2 if schedule == Schedule.INTERLEAVED_1F1B else 1)
    schedule = schedule or (
        Schedule.INTERLEAVED_1F1B.value if virtual > 1 else Schedule.ONE_F_ONE_B.value
    )
    if virtual > 1 and schedule != Schedule.INTERLEAVED_1F1B:
        raise PlanError(
            f"virtual_stages={virtual} needs schedule='interleaved-1f1b' (the {schedule} "
            "schedule runs one stage per rank)"
        )
    m = microbatches or next(
        (d for d in range(pp, replica_batch + 1) if replica_batch % d == 0), replica_batch
    )
    problem = microbatches_problem(schedule, pp, m)
    if problem:
        raise PlanError(problem)
    return PipelineChoice(schedule, virtual, m, stage_cuts or choose_stage_cuts(gm, pp * virtual))


def microbatches_problem(schedule: str, pp: int, m: int) -> str | None:
    """Why `schedule` cannot run `m` microbatches over `pp` stages, or None."""
    if schedule in (Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED_1F1B) and m < pp:
        return f"{schedule} needs at least pp={pp} microbatches, not {m}"
    rounds = max(1, m // pp)
    if schedule == Schedule.INTERLEAVED_1F1B and m % rounds:
        return (
            f"interleaved 1F1B runs microbatches in rounds of pp={pp}: {m} microbatches "
            f"do not split into {rounds} equal rounds; use a multiple of {pp}"
        )
    return None
