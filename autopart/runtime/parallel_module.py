"""ParallelModule: one rank's program, its process groups, and the training step."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.utils import _pytree as pytree

from autopart.batch import SEQ, split_batch
from autopart.degrees import MESH_AXES, Axis
from autopart.ops.groups import MeshGroups
from autopart.ops.loss_match import CrossEntropy
from autopart.ops.meta import COLLECTIVE, CollectiveInfo, TensorInfo
from autopart.ops.program import RankProgram
from autopart.plan import Plan
from autopart.policy import MasterWeights, outer_optimizer, sequence_multiple
from autopart.runtime.data_parallel import (
    ContextSums,
    ExpertShards,
    OptimizerFactory,
    build_data_parallel_state,
)
from autopart.runtime.executor import LocalExecutor
from autopart.runtime.faults import peer_lost, register_process
from autopart.runtime.full_state import full_state_dict
from autopart.runtime.loss import StepLoss, microbatch_shares, whole_output
from autopart.runtime.precision import Precision
from autopart.runtime.programs import ProgramsByShape, ShapedProgram

if TYPE_CHECKING:
    from autopart.runtime.pipeline import PipelineExecutor

LossFn = Callable[[Any, Any], torch.Tensor]
# Given a step's inputs of new shapes: this rank's program of the same plan made for
# them (holding the first program's tensors), its input shapes and dim ranges.
MakeProgram = Callable[
    [tuple], tuple[RankProgram, Sequence[TensorInfo | None], Mapping[str, tuple[int, float]]]
]


class ParallelModule(nn.Module):
    """Runs one rank's share of a plan. `train_step` does a whole optimizer step."""

    def __init__(
        self,
        program: RankProgram,
        plan: Plan,
        groups: MeshGroups,
        loss_fn: LossFn | None,
        optimizer: OptimizerFactory | None,
        input_shapes: Sequence[TensorInfo | None] = (),
        dim_ranges: Mapping[str, tuple[int, float]] | None = None,
        make_program: MakeProgram | None = None,
        recognized_loss: CrossEntropy | None = None,
    ) -> None:
        """`input_shapes`: the model's (flattened) inputs at the global batch, as
        captured, and `dim_ranges` the sizes each named dim may take; each step's inputs
        are checked against them. `make_program` makes the program again for inputs
        that differ only in sizes the capture kept static (runtime/programs.py).
        `recognized_loss`: `loss_fn` recognized as a standard cross-entropy, whose mean
        over counted tokens the batch's parts are weighted for."""
        super().__init__()
        self.stages = nn.ModuleList(program.stages)
        self.input_shapes = tuple(input_shapes)
        self.dim_ranges = dict(dim_ranges or {})
        self.steps = 0  # training steps begun, for errors that name one
        register_process()  # so that a survivor can name a rank that is lost
        self.stage_ids = program.stage_ids
        self.tp_layout = program.tp_layout
        self.cp_summed = program.cp_summed
        self.ep_sharded = program.ep_sharded
        # Logits the program returns sharded over the vocabulary, for a parallel loss.
        self.vocab_parallel_loss = program.vocab_parallel_loss
        self.plan = plan
        self.groups = groups
        self.loss_fn = loss_fn
        self.recognized_loss = recognized_loss
        self.precision = Precision(plan.precision, device_type=groups.device_type)
        self.executor = self._executor(program, loss_fn) if loss_fn else None
        self.programs = (
            ProgramsByShape(
                ShapedProgram(self.executor, self.input_shapes, self.dim_ranges),
                self._again(make_program) if make_program else None,
                groups,
            )
            if self.executor
            else None
        )
        self.state = (
            build_data_parallel_state(
                plan.zero,
                program.stages,
                groups.batch_group(),
                optimizer,
                plan.microbatches,
                plan.sync_every,
                plan.sync_warmup,
                plan.grad_compression,
                outer_optimizer(plan.outer_optimizer) if plan.outer_optimizer else None,
                plan.offload,
                ContextSums(groups.group(Axis.DP, Axis.CP), program.cp_summed)
                if program.cp_summed
                else None,
                ExpertShards(
                    groups.group(Axis.DP),
                    program.ep_sharded,
                    groups.batch_size,
                    groups.group(Axis.EP),
                )
                if program.ep_sharded
                else None,
                self.precision.dtype if plan.master_weights == MasterWeights.HOST else None,
            )
            if optimizer
            else None
        )

    def _executor(self, program: RankProgram, loss_fn: LossFn) -> LocalExecutor | PipelineExecutor:
        loss = StepLoss(loss_fn, self._tp_group).for_program(program)
        if self.plan.pp == 1:
            return LocalExecutor(program.stages[0], loss, self.plan.microbatches, self.precision)
        from autopart.runtime.pipeline import PipelineExecutor

        return PipelineExecutor(program, self.plan, self.groups, loss, self.precision)

    @property
    def _tp_group(self) -> dist.ProcessGroup | None:
        """The tp group, where there is one (the vocabulary-parallel loss runs over it)."""
        return self.groups.group(Axis.TP) if self.plan.tp > 1 else None

    def _again(self, make_program: MakeProgram) -> Callable[[tuple], ShapedProgram]:
        def again(inputs: tuple) -> ShapedProgram:
            assert self.executor is not None, "programs are made again for train_step only"
            program, shapes, ranges = make_program(inputs)
            runner = self.executor.for_program(program)
            return ShapedProgram(runner, tuple(shapes), dict(ranges))

        return again

    @property
    def graph(self) -> fx.GraphModule:
        """This rank's graph (its first stage's, under a pipeline):
        `pm.graph.print_readable()` shows every inserted collective."""
        return self._stage_graphs()[0]

    def _stage_graphs(self) -> list[fx.GraphModule]:
        # nn.ModuleList types its items as Module; these are the program's GraphModules.
        return [cast(fx.GraphModule, stage) for stage in self.stages]

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.state.optimizer if self.state else None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.plan.pp > 1:
            raise NotImplementedError("a pipelined model runs through train_step")
        with self._weights_16_bit():
            output = self.stages[0](*args, **kwargs)
        # The program may return logits sharded over the vocabulary (for the loss's
        # sake); the caller gets them whole.
        return whole_output(output, self.vocab_parallel_loss, self._tp_group)

    def _weights_16_bit(self) -> contextlib.AbstractContextManager[None]:
        """With master weights on the host the device's weights are 16-bit, which only
        the plan's autocast multiplies with its activations (passes/master_weights.py)."""
        if self.plan.master_weights == MasterWeights.HOST:
            return self.precision.autocast()
        return contextlib.nullcontext()

    def local_batch(self, batch: Any) -> Any:
        """This rank's slice of a global batch, on this rank's device."""
        local = split_batch(batch, self.groups.batch_rank, self.groups.batch_size)
        device = self.groups.device
        return pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), local)

    def train_step(self, inputs: Any, target: Any) -> torch.Tensor:
        """Forward, backward, gradient sync and optimizer step on the global batch
        `inputs`; returns the global mean loss, the same on every rank. Inputs that
        differ from the example only in sizes the capture kept static run a program
        made for their shapes (runtime/programs.py)."""
        if self.programs is None or self.state is None:
            raise ValueError("train_step needs parallelize(..., loss_fn=..., optimizer=...)")
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        plan = self.plan
        multiple = sequence_multiple(plan.cp, plan.tp, plan.sequence_parallel)
        executor = self.programs.serving(args, {SEQ: multiple})
        self.steps += 1
        try:
            return self._step(executor, args, target)
        except RuntimeError as e:
            lost = peer_lost(e, self.steps - 1, self.groups.timeout)
            if lost is None:
                raise
            raise lost from e

    def _step(
        self, executor: LocalExecutor | PipelineExecutor, args: tuple, target: Any
    ) -> torch.Tensor:
        assert self.state is not None, "train_step checked it"
        self.state.begin()
        dp, rank, m = self.groups.batch_size, self.groups.batch_rank, self.plan.microbatches
        shares = microbatch_shares(self.recognized_loss, target, dp, rank, m)
        local_loss = executor.run(self.local_batch(args), self.local_batch(target), shares)
        self.state.finish()
        loss = self._global_loss(local_loss)
        if self.precision.unscale(self.state.optimizer):
            self.state.step()
        return loss

    def _global_loss(self, local_loss: torch.Tensor) -> torch.Tensor:
        """The mean over the batch's shares (dp × ep) of the loss held by each share's
        reporting rank, delivered to every rank."""
        if dist.get_world_size() == 1:
            return local_loss
        contribution = (
            local_loss / self.groups.batch_size if self.groups.reports_loss else local_loss * 0
        )
        dist.all_reduce(contribution, group=self.groups.group(*MESH_AXES))
        return contribution

    def collectives(self) -> list[tuple[str, CollectiveInfo]]:
        """Every collective the rewrite inserted into this rank's graphs, in order:
        (node name, what it is, axis, process group, bytes per rank)."""
        return [
            (node.name, COLLECTIVE.get(node))
            for stage in self._stage_graphs()
            for node in stage.graph.nodes
            if COLLECTIVE.has(node)
        ]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter of the model, whole (unsharded), under its original FQN, on
        every rank. Collective: all ranks must call it."""
        return full_state_dict(self)

    def close(self) -> None:
        """Detach autopart's hooks from the model's parameters."""
        if self.state is not None:
            self.state.close()
        if self.executor is not None:
            self.executor.close()

    def train(self, mode: bool = True) -> ParallelModule:
        # The captured program is fixed in the mode it was captured in (an exported
        # graph refuses train()/eval()), so only this module's flag changes.
        self.training = mode
        return self
