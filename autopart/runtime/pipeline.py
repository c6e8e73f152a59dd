"""Pipeline parallelism at run time: this rank's stages under torch.distributed.pipelining.

Each stage module runs as a `PipelineStage` with static metadata: input and output
shapes come from the SHAPE analysis at this step's microbatch size, and which values
carry a gradient from the split. Pipelining then runs no trial forward and backward to
infer them, which would accumulate gradients and fire the data-parallel hooks. Stages are
made again when the batch's shape changes.

The schedule is the plan's: "gpipe" (ScheduleGPipe), "1f1b" (Schedule1F1B) or
"interleaved-1f1b" (ScheduleInterleaved1F1B, several stages per rank). The last stage
computes each microbatch's loss, divided by the number of microbatches, so the
accumulated gradients are those of the mean loss over the rank's batch, as with
`LocalExecutor`. Pipelining's own gradient scaling is off: it would divide the gradients
after the data-parallel all-reduce has started on them.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from itertools import chain
from typing import Any

import sympy
import torch
from torch import fx, nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.tensor import Shard
from torch.utils import _pytree as pytree

from autopart.batch import split_batch
from autopart.degrees import Axis
from autopart.ops.groups import MeshGroups
from autopart.ops.meta import CP_PLACE, NodeShape, TensorInfo, tensor_info
from autopart.ops.program import RankProgram
from autopart.ops.stage_info import PipelineInfo, output_values, pipeline_info
from autopart.plan import Plan
from autopart.policy import Schedule
from autopart.runtime.compiled import Compiled
from autopart.runtime.loss import StepLoss
from autopart.runtime.precision import Precision
from autopart.runtime.shared_params import SharedParameters

log = logging.getLogger("autopart.pipeline")

SCHEDULE_CLASSES = {
    Schedule.GPIPE: ScheduleGPipe,
    Schedule.ONE_F_ONE_B: Schedule1F1B,
    Schedule.INTERLEAVED_1F1B: ScheduleInterleaved1F1B,
}


class PipelineExecutor:
    """pp > 1: forward and backward of all microbatches, in the plan's schedule."""

    def __init__(
        self,
        program: RankProgram,
        plan: Plan,
        groups: MeshGroups,
        loss_fn: StepLoss,
        precision: Precision | None = None,
        compile: bool = False,
    ) -> None:
        """`compile`: run each stage compiled by inductor (runtime/compiled.py)."""
        self.precision = precision or Precision(plan.precision, groups.device_type)
        self.compile = compile
        assert plan.schedule is not None, "a plan with pp > 1 has a schedule (Plan checks it)"
        self.schedule_type = SCHEDULE_CLASSES[Schedule(plan.schedule)]
        self.microbatches = plan.microbatches
        self.group = groups.group(Axis.PP)
        self.tp = groups.size(Axis.TP)
        self.cp = groups.size(Axis.CP)
        self.loss_fn = loss_fn
        self.shared = SharedParameters(program.stages, program.stage_ids, groups, plan.microbatches)
        self._targets: list[Any] = []
        self._losses: list[torch.Tensor] = []
        self._use(program)

    def _use(self, program: RankProgram) -> None:
        """Run `program`'s stages, in schedules made for them."""
        self.modules = [_StageOutputs(gm, self.precision, self.compile) for gm in program.stages]
        self.step_loss = self.loss_fn.for_program(program)
        self.infos = [pipeline_info(gm) for gm in program.stages]
        self.stage_ids = program.stage_ids
        self.num_stages = self.infos[0].stages
        self.device = _device(program.stages[0])
        self._schedules: dict[tuple, Any] = {}

    def for_program(self, program: RankProgram) -> PipelineExecutor:
        """The same pipeline over another program of the plan (made for inputs of other
        shapes): its stages and schedules are the program's own; the tied weights'
        process groups and hooks, on the tensors every program shares, are this one's."""
        other = copy.copy(self)
        other._use(program)
        return other

    @property
    def runs_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def runs_last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    def close(self) -> None:
        """Remove the tied-weight hooks from the model's parameters."""
        self.shared.close()

    def run(self, args: tuple, target: Any, shares: list[float]) -> torch.Tensor:
        """Forward and backward over the rank's batch. Returns its mean loss (detached)
        where this rank runs the last stage, zero elsewhere."""
        return self._run(args, target, shares, forward_only=False)

    def evaluate(self, args: tuple, target: Any, shares: list[float]) -> torch.Tensor:
        """The loss `run` returns, forward only: no gradient."""
        with torch.no_grad():
            return self._run(args, target, shares, forward_only=True)

    def _run(
        self, args: tuple, target: Any, shares: list[float], forward_only: bool
    ) -> torch.Tensor:
        m = self.microbatches
        schedule = self._schedule(split_batch(args, 0, m, "microbatches"), forward_only)
        # Pipelining splits `target` along dim 0; handing it microbatch indices lets any
        # target (a pytree) be split exactly as LocalExecutor splits it.
        self._targets = [split_batch(target, i, m, "microbatches") for i in range(m)]
        self._shares = shares
        self._losses = []
        # The replicas of tied weights take the owner's value, trained since they last did.
        self.shared.begin()
        (schedule.eval if forward_only else schedule.step)(
            *(args if self.runs_first else ()),
            target=torch.arange(m) if self.runs_last else None,
            return_outputs=False,
        )
        self.shared.finish()
        return sum(self._losses, torch.zeros((), device=self.device))

    def _microbatch_loss(self, outputs: tuple, index: torch.Tensor) -> torch.Tensor:
        out_spec = self.modules[-1].out_spec
        assert out_spec is not None, "the loss follows the last stage's forward"
        output = pytree.tree_unflatten(list(outputs), out_spec)
        with self.precision.autocast():
            i = int(index)
            loss = self.step_loss.part(output, self._targets[i], self._shares[i])
        self._losses.append(loss.detach().float())
        return self.precision.scale(loss)

    def _schedule(self, microbatch: tuple, forward_only: bool = False):
        """The schedule for microbatches of this shape. A forward-only run (`evaluate`)
        has schedules of its own: pipelining sets a schedule's stages up again each time
        it switches between forward only and forward and backward."""
        leaves = pytree.tree_leaves(microbatch)
        shapes = tuple(tuple(x.shape) for x in leaves if isinstance(x, torch.Tensor))
        key = (forward_only, shapes)
        if key not in self._schedules:
            sizes = _bind_dims(self.infos[0].model_inputs, leaves)
            if self._schedules and shapes not in {s for _, s in self._schedules}:
                log.info("pipeline stages for a new microbatch shape %s", shapes)
            stages = [
                self._stage(module, info, sizes, leaves)
                for module, info in zip(self.modules, self.infos)
            ]
            self._schedules[key] = self._make_schedule(stages)
        return self._schedules[key]

    def _stage(
        self, module: _StageOutputs, info: PipelineInfo, sizes: dict, leaves: list
    ) -> PipelineStage:
        graph = module.stage.graph
        if info.stage == 0:
            inputs = tuple(x for x in leaves if isinstance(x, torch.Tensor))
        else:
            placeholders = graph.find_nodes(op="placeholder")
            inputs = tuple(
                _example(self._local(n, tensor_info(n)), sizes, grad, self.device)
                for n, grad in zip(placeholders, info.input_grads)
            )
        outputs = tuple(
            _example(self._local(v, self._output_info(info, graph, v)), sizes, grad, self.device)
            for v, grad in zip(output_values(graph), info.output_grads)
        )
        return PipelineStage(
            module,
            info.stage,
            self.num_stages,
            self.device,
            input_args=inputs,
            output_args=outputs,
            group=self.group,
        )

    def _local(self, value: fx.Node, info: TensorInfo) -> TensorInfo:
        """A value as this rank holds it: its chunks of the sequence where context
        parallelism shards it (`CP_PLACE`)."""
        if self.cp == 1 or not CP_PLACE.has(value):
            return info
        place = CP_PLACE.get(value)
        if not isinstance(place, Shard):
            return info
        shape = list(info.shape)
        shape[place.dim] = shape[place.dim] / self.cp
        return TensorInfo(tuple(shape), info.dtype)

    def _output_info(self, info: PipelineInfo, graph: fx.Graph, value: fx.Node) -> TensorInfo:
        """An output of a stage as it leaves this rank: the last stage's logits left
        sharded over the vocabulary for the loss hold a tp-th of the vocabulary (SHAPE
        holds one device's shapes)."""
        whole = tensor_info(value)
        sharded = self.step_loss.sharded
        if info.stage < info.stages - 1 or sharded is None:
            return whole
        (output,) = graph.find_nodes(op="output")
        if pytree.tree_leaves(output.args[0])[sharded.logits] is not value:
            return whole
        return TensorInfo((*whole.shape[:-1], whole.shape[-1] // self.tp), whole.dtype)

    def _make_schedule(self, stages: Sequence[PipelineStage]):
        loss_fn = self._microbatch_loss
        if self.schedule_type is ScheduleInterleaved1F1B:
            return ScheduleInterleaved1F1B(
                list(stages), self.microbatches, loss_fn=loss_fn, scale_grads=False
            )
        if len(stages) > 1:
            raise ValueError(
                f"the {self.schedule_type.__name__} schedule runs one stage per rank, not "
                f"{len(stages)}: use schedule='interleaved-1f1b' with virtual stages"
            )
        return self.schedule_type(stages[0], self.microbatches, loss_fn=loss_fn, scale_grads=False)


class _StageOutputs(nn.Module):
    """A stage as pipelining wants it: a flat tuple of contiguous tensors out (they are
    sent as they are), in the dtypes its metadata declares (under autocast a value may
    come out in 16 bits where the captured program had 32). The output's structure is
    kept, so the last stage's output can be rebuilt for the loss function."""

    def __init__(self, stage: fx.GraphModule, precision: Precision, compile: bool) -> None:
        super().__init__()
        self.stage = stage
        self.compiled = Compiled(stage) if compile else None
        self.precision = precision
        info = pipeline_info(stage)
        self.sent_dtypes = (
            [tensor_info(v).dtype for v in output_values(stage.graph)]
            if info.stage < info.stages - 1
            else None
        )
        self.out_spec: pytree.TreeSpec | None = None

    def forward(self, *args: Any) -> tuple[torch.Tensor, ...]:
        with self.precision.autocast():
            output = (self.compiled or self.stage)(*args)
        leaves, self.out_spec = pytree.tree_flatten(output)
        if self.sent_dtypes is not None:
            leaves = [x.to(dtype) for x, dtype in zip(leaves, self.sent_dtypes)]
        return tuple(x.contiguous() for x in leaves)


def _bind_dims(model_inputs: tuple[NodeShape, ...], leaves: list) -> dict:
    """The named dims ("batch", ...) of the model's inputs, at this microbatch's sizes."""
    sizes: dict[sympy.Symbol, int] = {}
    for info, leaf in zip(model_inputs, leaves):
        if isinstance(info, TensorInfo) and isinstance(leaf, torch.Tensor):
            for dim, size in zip(info.shape, leaf.shape):
                if isinstance(dim, sympy.Symbol):
                    sizes[dim] = sympy.Integer(size)
    return sizes


def _example(
    info: TensorInfo, sizes: dict, requires_grad: bool, device: torch.device
) -> torch.Tensor:
    shape = [sympy.sympify(d).xreplace(sizes) for d in info.shape]
    if not all(d.is_Integer for d in shape):
        raise ValueError(
            f"a pipeline stage value of shape {info.shape} depends on sizes the model's "
            f"inputs do not name ({sizes}): only named dynamic dims can vary"
        )
    return torch.empty(
        [int(d) for d in shape], dtype=info.dtype, device=device, requires_grad=requires_grad
    )


def _device(stage: nn.Module) -> torch.device:
    tensor = next(chain(stage.parameters(), stage.buffers()), None)
    return tensor.device if tensor is not None else torch.device("cpu")
