"""Tensor parallelism on one of dynamo's graphs: captured as a model, planned and
rewritten by autopart's own passes, then fed the user's whole parameters.

The graph becomes a `DynamoModel`, which `autopart.capture` exports and the solver plans
with the backend's pins (pipelines, microbatches and recomputation pinned off: the
user's loop runs one forward and one backward per call). The tensor-parallel rewrite
then produces this rank's program; its parameter reads become inputs, and each
tp-sharded parameter is fed as this rank's slice of the user's whole parameter
(`tp_slice`), so backward writes the user's `.grad`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.distributed.tensor import Shard
from torch.utils import _pytree as pytree

from autopart.api import captured_for_planning
from autopart.compile.graph_module import DynamoModel, lift_parameters
from autopart.degrees import Axis
from autopart.mesh import Mesh
from autopart.ops.groups import MeshGroups
from autopart.ops.shards import local_shard
from autopart.passes.rewrite import rank_program
from autopart.passes.runner import RankTarget
from autopart.plan import Plan
from autopart.solver import Pins, make_plan

log = logging.getLogger("autopart.compile")

# What the user's unchanged loop rules out: a pipeline and accumulation (one forward per
# step), recomputation and sequence parallelism, and context and expert parallelism
# (every process feeds its own share of the batch, and its gradient sync knows neither).
LOOP_PINS = {
    "pp": 1,
    "cp": 1,
    "ep": 1,
    "microbatches": 1,
    "recompute": False,
    "sequence_parallel": False,
}


# Compiles a graph given example inputs (inductor's `compile_fx`, in the backend).
Compiler = Callable[[fx.GraphModule, Sequence[Any]], Callable[..., Any]]


@dataclass
class TensorParallelGraph:
    """This rank's program of one dynamo graph. It takes the graph's data inputs, then
    the whole `params` (its `parameter_inputs`), and returns what the graph returns."""

    program: fx.GraphModule
    params: list[nn.Parameter]
    is_data: list[bool]  # for each of dynamo's inputs: not a parameter
    out_spec: Any
    # What runs `program`: itself, or inductor's compiled code of it (`compiled_by`).
    runs: Callable[..., Any] | None = None

    @property
    def parameter_inputs(self) -> list[fx.Node]:
        placeholders = list(self.program.graph.find_nodes(op="placeholder"))
        return placeholders[len(placeholders) - len(self.params) :]

    def compiled_by(
        self,
        compile: Compiler,
        args: Sequence[Any],
    ) -> TensorParallelGraph:
        """This program run by `compile(program, example inputs)`, given dynamo's
        example `args` (fake tensors, where dynamo traced with them)."""
        data = [x for x, keep in zip(args, self.is_data) if keep]
        fake = torch._guards.detect_fake_mode(args)
        params = [fake.from_tensor(p) for p in self.params] if fake else list(self.params)
        return dataclasses.replace(self, runs=compile(self.program, [*data, *params]))

    def __call__(self, *args: Any) -> Any:
        data = [x for x, keep in zip(args, self.is_data) if keep]
        out = (self.runs or self.program)(*data, *self.params)
        return out if self.out_spec is None else pytree.tree_unflatten(list(out), self.out_spec)


def plan_tensor_parallel(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    mesh: Mesh,
    groups: MeshGroups,
    pins: dict[str, Any],
) -> TensorParallelGraph:
    """Plan and rewrite dynamo's `gm` for this rank; raises what capture or the solver
    raise when the graph cannot be planned."""
    model = DynamoModel(gm, example_inputs)
    data = pytree.tree_map_only(torch.Tensor, torch.clone, model.data_inputs(example_inputs))
    # A capture of its own: outside dynamo's tracing context, whose shape environment
    # would otherwise take the exporter's guards for the frame being compiled.
    with torch._guards.tracing(None):
        captured = captured_for_planning(model, data)
    dp = pins["dp"]
    # Each process feeds its own share, so the global batch is dp of them.
    whole = pytree.tree_map_only(
        torch.Tensor, lambda t: torch.cat([t] * dp) if t.dim() else t, captured.example_args
    )
    planning = dataclasses.replace(captured, example_args=whole)
    plan = make_plan(planning, mesh, Pins.of(**pins, **LOOP_PINS))
    # ZeRO runs by owners over the user's parameters (compile/zero.py), not in the graph.
    program_plan = plan.with_changes(zero=0)
    ctx = captured.context(target=RankTarget(program_plan, groups))
    rewritten = rank_program(captured.gm, ctx)
    program = rewritten.stages[0]
    order, out_spec = lift_parameters(program, dict(ctx.params))
    _feed_slices(program, order, program_plan, groups.rank(Axis.TP), rewritten.tp_layout)
    params = [model.get_parameter(name) for name in order]
    sharded = [
        p for name, p in zip(order, params) if isinstance(plan.placement(name, Axis.TP), Shard)
    ]
    log.info(
        "autopart: graph planned for tp=%d: %d of %d parameters sharded (%.0f%% of the elements)",
        plan.tp,
        len(sharded),
        len(params),
        100 * sum(p.numel() for p in sharded) / max(1, sum(p.numel() for p in params)),
    )
    is_data = [slot is None for slot in model.slots]
    return TensorParallelGraph(program, params, is_data, out_spec)


def _feed_slices(
    gm: fx.GraphModule,
    order: list[str],
    plan: Plan,
    rank: int,
    layout: dict[str, tuple[int, int]],
) -> None:
    """Make each tp-sharded parameter input take the whole parameter and slice it."""
    inputs = list(gm.graph.find_nodes(op="placeholder"))[-len(order) :] if order else []
    for name, node in zip(order, inputs):
        place = plan.placement(name, Axis.TP)
        if not isinstance(place, Shard):
            continue
        with gm.graph.inserting_after(node):
            sliced = gm.graph.call_function(
                tp_slice, (node, place.dim, plan.tp, rank, layout.get(name, (0, 1))[1])
            )
        node.replace_all_uses_with(sliced, delete_user_cb=lambda user, s=sliced: user is not s)
    gm.graph.lint()
    gm.recompile()


class _TpSlice(torch.autograd.Function):
    """This rank's slice of a whole parameter. Backward returns the slice's gradient in
    place within a zero gradient of the whole, times tp: summed over the world and
    divided by its size, as every other parameter's gradient is, that is the mean over
    the data-parallel replicas."""

    @staticmethod
    def forward(ctx: Any, p: torch.Tensor, dim: int, tp: int, rank: int, parts: int) -> Any:
        ctx.shape, ctx.args = p.shape, (dim, tp, rank, parts)
        return local_shard(p.detach(), dim, tp, rank, parts).clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        dim, tp, rank, parts = ctx.args
        whole = grad.new_zeros(ctx.shape)
        for part, piece in zip(whole.chunk(parts, dim), grad.chunk(parts, dim)):
            part.chunk(tp, dim)[rank].copy_(piece).mul_(tp)
        return whole, None, None, None, None


def tp_slice(p: torch.Tensor, dim: int, tp: int, rank: int, parts: int) -> torch.Tensor:
    return _TpSlice.apply(p, dim, tp, rank, parts)
