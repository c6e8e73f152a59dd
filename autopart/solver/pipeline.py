"""The pipeline's shape for pp > 1: the search's schedule, virtual stages and
microbatches (`search._pipelines` enumerates them, pinned or not), checked against the
schedules' own requirements, so that a plan that validates also runs; and its stage
cuts.
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
    schedule: str | None,
    virtual_stages: int,
    microbatches: int,
    stage_cuts: tuple[str, ...] = (),
) -> PipelineChoice:
    """The search's choices (pinned ones among them) where the schedule runs them;
    without `stage_cuts`, cuts balanced in FLOPs."""
    if pp == 1:
        return PipelineChoice(schedule, virtual_stages, microbatches, ())
    assert schedule is not None, "a pipeline's Choices carry a schedule"
    if virtual_stages > 1 and schedule != Schedule.INTERLEAVED_1F1B:
        raise PlanError(
            f"virtual_stages={virtual_stages} needs schedule='interleaved-1f1b' (the "
            f"{schedule} schedule runs one stage per rank)"
        )
    problem = microbatches_problem(schedule, pp, microbatches)
    if problem:
        raise PlanError(problem)
    cuts = stage_cuts or choose_stage_cuts(gm, pp * virtual_stages)
    return PipelineChoice(schedule, virtual_stages, microbatches, cuts)


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
