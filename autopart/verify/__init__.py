"""`autopart.verify`: does a plan change the model's numbers, and if so, where first?

    report = autopart.verify(model, plan, inputs, target, loss_fn, optimizer, steps=3)
    print(report)  # the largest differences, and the first operator that diverges

The plan runs on a local Gloo world of its size and the unmodified model on one device,
from the same weights and batch. The report gives the largest relative difference of
the loss (over `steps` steps), of the model's outputs and of each parameter's gradient
(first step). Every operator's output in the first step's forward is recorded on every
rank and on one device (probes.py) and set side by side (compare.py): on a mismatch the
report names the first operator, in the single-device graph's order, whose output
diverges beyond tolerance, by module path and op. The single-device side is
reference.py; the report's types and limits, report.py.

`on_rank` is the per-rank half, for a world that is already running (under torchrun);
`verify` starts the world itself (`autopart.testing.run_world`), so what it is given is
sent to separate processes: pass importable functions or `functools.partial`, not
lambdas, and call it under `if __name__ == "__main__":` in a script.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.tensor import Replicate

from autopart.api import parallelize
from autopart.degrees import Axis
from autopart.mesh import Mesh
from autopart.ops.aten import op_name
from autopart.ops.meta import MODULE_PATH, TP_PLACE
from autopart.plan import MeshSpec, Plan
from autopart.runtime.parallel_module import LossFn, OptimizerFactory, ParallelModule
from autopart.runtime.pieces import assemble
from autopart.verify import reference as single_device
from autopart.verify.compare import RankValue, node_difference, relative_difference
from autopart.verify.probes import GradientRecorder, Recorder, install_probes
from autopart.verify.report import LOSS_RTOL, TENSOR_RTOL, Divergence, VerifyReport

__all__ = ["LOSS_RTOL", "TENSOR_RTOL", "Divergence", "VerifyReport", "on_rank", "verify"]


def verify(
    model: nn.Module,
    plan: Plan,
    inputs: Any,
    target: Any,
    loss_fn: LossFn,
    optimizer: OptimizerFactory,
    steps: int = 3,
) -> VerifyReport:
    """Run `plan` on a local Gloo world of its size beside one device; the report."""
    from autopart.testing import run_world

    _check_axes(plan)
    reports = run_world(
        on_rank, plan.degrees.world_size, model, plan, inputs, target, loss_fn, optimizer, steps
    )
    return reports[0]


def _check_axes(plan: Plan) -> None:
    """Refuse the axes whose ranks hold other tokens' (or rows') values than the (dp, tp)
    coordinates the comparison sets side by side: it would report false divergences."""
    split = [f"{a}={plan.degrees[a]}" for a in (Axis.CP, Axis.EP) if plan.degrees[a] > 1]
    if split:
        raise ValueError(
            "autopart verify compares operators by dp and tp coordinates, and does not yet "
            f"reassemble what {' and '.join(split)} splits: verify the plan with those axes "
            "at 1 (the tests check context and expert parallelism against one device)"
        )


def on_rank(
    model: nn.Module,
    plan: Plan,
    inputs: Any,
    target: Any,
    loss_fn: LossFn,
    optimizer: OptimizerFactory,
    steps: int = 3,
) -> VerifyReport | None:
    """The per-rank half of `verify` in a running world: rank 0 returns the report."""
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    _check_axes(plan)
    if plan.precision != "fp32":
        raise ValueError(
            f"autopart verify compares fp32 plans with an fp32 run on one device; this plan "
            f"is {plan.precision}: verify plan.with_changes(precision='fp32'), which lays "
            "the work out the same way"
        )
    mesh = Mesh.local()
    reference = copy.deepcopy(model) if dist.get_rank() == 0 else None
    if plan.mesh.world_size == mesh.world_size:  # numbers do not depend on the device
        plan = replace(plan, mesh=MeshSpec.of(mesh))
    pm = parallelize(model, mesh, args, loss_fn=loss_fn, optimizer=optimizer, plan=plan)
    recorder, gradients = Recorder(), GradientRecorder(pm)
    placements: dict[str, Any] = {}
    for stage in pm.stages:
        assert isinstance(stage, fx.GraphModule)
        placements.update((n.name, TP_PLACE.get(n)) for n in stage.graph.nodes if TP_PLACE.has(n))
        install_probes(stage, recorder)
    losses = []
    for _ in range(steps):
        losses.append(pm.train_step(args, target).item())
        recorder.active = False  # the first step's forward only
    mine = {
        "coords": (pm.groups.rank(Axis.DP), pm.groups.rank(Axis.TP)),
        "values": recorder.values,
        "placements": placements,
        "gradients": gradients.pieces,
    }
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    pm.close()
    if reference is None:
        return None
    return _report(reference, pm, args, target, loss_fn, optimizer, steps, losses, gathered)


def _report(
    model: nn.Module,
    pm: ParallelModule,
    args: tuple,
    target: Any,
    loss_fn: LossFn,
    optimizer: OptimizerFactory,
    steps: int,
    losses: list[float],
    ranks: list[dict[str, Any]],
) -> VerifyReport:
    plan = pm.plan
    values, order, outputs, graph = single_device.operator_values(model, args)
    reference_losses, reference_grads = single_device.training(
        model, args, target, loss_fn, optimizer, steps
    )
    compared, skipped, first, output_gap = 0, 0, None, 0.0
    for name in order:
        gap = node_difference(
            values[name], _rank_values(ranks, name), plan.dp, plan.tp, plan.microbatches
        )
        if gap is None:
            skipped += 1
            continue
        compared += 1
        if name in outputs:
            output_gap = max(output_gap, gap)
        if first is None and gap > TENSOR_RTOL:
            node = graph[name]
            first = Divergence(MODULE_PATH.get(node, ""), op_name(node), name, gap)
    return VerifyReport(
        plan=f"dp={plan.dp} tp={plan.tp} pp={plan.pp} zero={plan.zero} "
        f"microbatches={plan.microbatches}",
        world=len(ranks),
        steps=steps,
        loss=max(
            (relative_difference(torch.tensor(a), torch.tensor(b)))
            for a, b in zip(losses, reference_losses)
        ),
        outputs=output_gap,
        gradients=_gradient_differences(ranks, reference_grads),
        compared=compared,
        not_compared=skipped,
        first_divergence=first,
        losses=losses,
        reference_losses=reference_losses,
    )


def _rank_values(ranks: list[dict[str, Any]], name: str) -> list[RankValue]:
    out = []
    for rank in ranks:
        dp, tp = rank["coords"]
        placement = rank["placements"].get(name, Replicate())
        if placement is None:  # no piece of the single-device value
            return []
        for k, value in enumerate(rank["values"].get(name, ())):
            out.append(RankValue(dp, tp, k, placement, value))
    return out


def _gradient_differences(
    ranks: list[dict[str, Any]], reference: dict[str, torch.Tensor]
) -> dict[str, float]:
    """Each parameter's gradient, rebuilt from every rank's pieces, against one device's;
    infinite where some part of it no rank holds."""
    whole = assemble(piece for rank in ranks for piece in rank["gradients"])
    out = {}
    for name, want in reference.items():
        got = whole.get(name)
        complete = got is not None and bool(got[1].all())
        out[name] = relative_difference(got[0], want) if got and complete else float("inf")
    return out
