"""The user's pins, and the plan they determine.

A pin left as None is the solver's choice (`solver.search`); a value fixes it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.tensor import Placement, Replicate, Shard

from autopart.batch import batch_size, check_divisible
from autopart.capture import BATCH, Captured
from autopart.cost_models import Choices, predict
from autopart.mesh import Mesh
from autopart.plan import Alternative, MeshSpec, Plan, PlanError
from autopart.plan_format import format_bytes
from autopart.solver.pipeline import choose_pipeline
from autopart.solver.search import Candidate, NoPlanFits, search
from autopart.solver.tensor_parallel import choose_tp_placements

MAX_ALTERNATIVES = 4


@dataclass(frozen=True, slots=True)
class Pins:
    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    zero: int | None = None
    microbatches: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None
    recompute: tuple[str, ...] | None = None
    precision: str = "fp32"
    sequence_parallel: bool = False


def make_plan(captured: Captured, mesh: Mesh, pins: Pins) -> Plan:
    """The plan for `captured` on `mesh`: the search's choice among what `pins` allow,
    with its tensor-parallel layout, pipeline cuts, predictions and runners-up."""
    batch = batch_size((captured.example_args, captured.example_kwargs))
    if pins.dp is not None:
        check_divisible(batch, pins.dp, "dp")
    if pins.dp and pins.tp and pins.pp:
        mesh.check_factorization(pins.dp, pins.tp, pins.pp)
    dims = {k: v for k, v in captured.dim_sizes.items() if k != BATCH}
    try:
        found = search(captured.gm, captured.parameter_names, mesh, pins, batch, dims)
    except NoPlanFits as e:
        raise PlanError(f"{e}{_what_fits(captured, mesh, pins, batch, dims)}") from None
    best = found[0].choices
    pipeline = choose_pipeline(
        captured.gm,
        best.pp,
        batch // best.dp,
        best.schedule,
        best.virtual_stages,
        best.microbatches,
    )
    plan = Plan(
        mesh=MeshSpec.of(mesh),
        fingerprint=captured.fingerprint,
        global_batch=batch,
        dp=best.dp,
        tp=best.tp,
        pp=best.pp,
        zero=best.zero,
        microbatches=pipeline.microbatches,
        schedule=pipeline.schedule,
        virtual_stages=pipeline.virtual_stages,
        stage_cuts=pipeline.stage_cuts,
        precision=pins.precision,
        sequence_parallel=pins.sequence_parallel,
        recompute=best.recompute,
        placements=_placements(captured, best.tp, best.zero),
    )
    alternatives = tuple(_alternative(c) for c in found[1 : MAX_ALTERNATIVES + 1])
    return plan.with_changes(
        predicted=predict(captured.gm, mesh, Choices.of(plan), dims=dims),
        alternatives=alternatives,
    )


def _what_fits(captured: Captured, mesh: Mesh, pins: Pins, batch: int, dims: dict) -> str:
    """With every axis unpinned, the plan that would fit, as advice."""
    open_pins = Pins(precision=pins.precision)
    if pins == open_pins:
        return ""
    try:
        c = search(captured.gm, captured.parameter_names, mesh, open_pins, batch, dims)[0]
    except NoPlanFits:
        return ""
    what = c.choices
    return (
        f". What fits: dp={what.dp} tp={what.tp} pp={what.pp} zero={what.zero}"
        f"{' with recomputation' if what.recompute else ''} "
        f"({format_bytes(c.predicted.peak_memory_bytes)} per rank)"
    )


def _alternative(candidate: Candidate) -> Alternative:
    c, p = candidate.choices, candidate.predicted
    note = "recompute" if c.recompute else ""
    return Alternative(
        c.dp,
        c.tp,
        c.pp,
        c.zero,
        c.microbatches,
        c.schedule,
        p.step_time_s,
        p.peak_memory_bytes,
        note,
    )


def _placements(captured: Captured, tp: int, zero: int) -> dict[str, tuple[Placement, ...]]:
    """(dp, tp) placements per parameter: ZeRO-3 shards every parameter over dp."""
    tp_places = choose_tp_placements(captured.gm, captured.parameter_names, tp) if tp > 1 else {}
    dp_place = Shard(0) if zero == 3 else Replicate()
    return {
        fqn: (dp_place, tp_places.get(fqn, Replicate()))
        for fqn, _ in captured.gm.named_parameters()
    }
