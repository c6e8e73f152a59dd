"""The user's pins, and the plan they determine.

A pin left as None is the solver's choice. Until a search fills them in, unpinned axes
default to pure data parallelism over the whole mesh, which is always correct.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.tensor import Placement, Replicate, Shard

from autopart.batch import batch_size, check_divisible
from autopart.capture import BATCH, Captured
from autopart.cost_models import Choices, predict
from autopart.mesh import Mesh
from autopart.plan import MeshSpec, Plan
from autopart.solver.pipeline import choose_pipeline
from autopart.solver.tensor_parallel import choose_tp_placements


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
    world = mesh.world_size
    tp = pins.tp or 1
    pp = pins.pp or 1
    dp = pins.dp or world // (tp * pp)
    mesh.check_factorization(dp, tp, pp)
    batch = batch_size((captured.example_args, captured.example_kwargs))
    check_divisible(batch, dp, "dp")
    pipeline = choose_pipeline(
        captured.gm, pp, batch // dp, pins.schedule, pins.virtual_stages, pins.microbatches
    )
    microbatches = pipeline.microbatches
    check_divisible(batch, dp * microbatches, "dp×microbatches" if microbatches > 1 else "dp")
    zero = pins.zero or 0
    placements = _placements(captured, tp, zero)
    plan = Plan(
        mesh=MeshSpec.of(mesh),
        fingerprint=captured.fingerprint,
        global_batch=batch,
        dp=dp,
        tp=tp,
        pp=pp,
        zero=zero,
        microbatches=microbatches,
        schedule=pipeline.schedule,
        virtual_stages=pipeline.virtual_stages,
        stage_cuts=pipeline.stage_cuts,
        precision=pins.precision,
        sequence_parallel=pins.sequence_parallel,
        recompute=tuple(pins.recompute or ()),
        placements=placements,
    )
    other_dims = {k: v for k, v in captured.dim_sizes.items() if k != BATCH}
    return plan.with_changes(
        predicted=predict(captured.gm, mesh, Choices.of(plan), dims=other_dims)
    )


def _placements(captured: Captured, tp: int, zero: int) -> dict[str, tuple[Placement, ...]]:
    """(dp, tp) placements per parameter: ZeRO-3 shards every parameter over dp."""
    tp_places = choose_tp_placements(captured.gm, captured.parameter_names, tp) if tp > 1 else {}
    dp_place = Shard(0) if zero == 3 else Replicate()
    return {
        fqn: (dp_place, tp_places.get(fqn, Replicate()))
        for fqn, _ in captured.gm.named_parameters()
    }
