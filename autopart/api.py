"""The one-line entry points. They only sequence the stages:
capture → analyze → solve → rewrite → run. Each stage lives in its own package."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from autopart.batch import split_batch
from autopart.capture import Captured, capture
from autopart.mesh import Mesh
from autopart.passes import analyze
from autopart.passes.rewrite import rank_program
from autopart.plan import Plan
from autopart.runtime.groups import MeshGroups
from autopart.runtime.parallel_module import LossFn, OptimizerFactory, ParallelModule
from autopart.runtime.weights import Weights
from autopart.solver import Pins, make_plan


def plan(
    model: nn.Module,
    mesh: Mesh,
    example_inputs: Any,
    *,
    loss_fn: LossFn | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    precision: str = "fp32",
    dp: int | None = None,
    tp: int | None = None,
    pp: int | None = None,
    zero: int | None = None,
    microbatches: int | None = None,
    schedule: str | None = None,
    virtual_stages: int | None = None,
    recompute: tuple[str, ...] | None = None,
    sequence_parallel: bool = False,
) -> Plan:
    """Choose how to run `model` on `mesh` for the global batch `example_inputs`.
    A pin left as None is the solver's choice."""
    pins = Pins(
        dp, tp, pp, zero, microbatches, schedule, virtual_stages, recompute, precision,
        sequence_parallel,
    )
    return make_plan(_captured(model, example_inputs, example_kwargs), mesh, pins)


def parallelize(
    model: nn.Module,
    mesh: Mesh,
    example_inputs: Any,
    *,
    loss_fn: LossFn | None = None,
    optimizer: OptimizerFactory | None = None,
    plan: Plan | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    weights: Weights | None = None,
    **pins: Any,
) -> ParallelModule:
    """Capture, plan (unless `plan` is given), rewrite and return the per-rank module.
    The model's parameters are trained in place where they are not sharded. A model
    built on the meta device (`autopart.init_empty_weights()`) takes its `weights` from
    a state dict of whole tensors or a torch.distributed.checkpoint directory; each
    rank loads only its own pieces."""
    captured = _captured(model, example_inputs, example_kwargs)
    if plan is None:
        plan = make_plan(captured, mesh, Pins(**pins))
    elif pins:
        raise TypeError(f"pass either a plan or pins, not both (got pins {sorted(pins)})")
    plan.check_compatible(captured.fingerprint, mesh)
    parts = plan.dp * plan.microbatches
    if not captured.admits_batch(plan.global_batch // parts):
        # The model specialized on the batch size: capture again at the per-rank shape.
        local_inputs = split_batch(captured.example_args, 0, parts)
        captured = _captured(model, local_inputs, example_kwargs)
    groups = MeshGroups(mesh.device_mesh(dp=plan.dp, tp=plan.tp, pp=plan.pp))
    program = rank_program(captured, plan, groups, weights)
    return ParallelModule(program, plan, groups, loss_fn, optimizer)


def _captured(model: nn.Module, example_inputs: Any, example_kwargs: Any) -> Captured:
    captured = capture(model, example_inputs, example_kwargs)
    analyze(captured.gm, captured.context())
    return captured
