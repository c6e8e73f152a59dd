"""ParallelModule: one rank's program, its process groups, and the training step."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.utils import _pytree as pytree

from autopart.batch import SEQ, batch_size, split_batch
from autopart.degrees import MESH_AXES, Axis
from autopart.ops.groups import MeshGroups
from autopart.ops.loss_match import CrossEntropy
from autopart.ops.meta import COLLECTIVE, CollectiveInfo, TensorInfo
from autopart.ops.program import RankProgram
from autopart.plan import Plan
from autopart.policy import MasterWeights, sequence_multiple
from autopart.runtime.data_parallel import build_data_parallel_state
from autopart.runtime.dp_types import ContextSums, ExpertShards, OptimizerFactory, SyncSettings
from autopart.runtime.executor import LocalExecutor
from autopart.runtime.faults import peer_lost, register_process
from autopart.runtime.full_state import full_state_dict
from autopart.runtime.grad_norm import GradientNorm
from autopart.runtime.host_memory import keep_freed_memory
from autopart.runtime.loss import StepLoss, counted_tokens, shares_of, whole_output
from autopart.runtime.modes import EvalPrograms, MakeProgram, filled
from autopart.runtime.precision import Precision
from autopart.runtime.programs import ProgramsByShape, ShapedProgram
from autopart.runtime.step_sums import StepSums, input_hashes, is_finite, sum_step
from autopart.runtime.training import ConventionMismatch, NonFiniteLoss, TrainingOptions

if TYPE_CHECKING:
    from autopart.runtime.pipeline import PipelineExecutor

LossFn = Callable[[Any, Any], torch.Tensor]


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
        training: TrainingOptions | None = None,
        example_batch: int | None = None,
    ) -> None:
        """`input_shapes`: the model's (flattened) inputs at the global batch, as
        captured, and `dim_ranges` the sizes each named dim may take; each step's inputs
        are checked against them. `make_program` makes the program again for inputs
        that differ only in sizes the capture kept static (runtime/programs.py).
        `recognized_loss`: `loss_fn` recognized as a standard cross-entropy, whose mean
        over counted tokens the batch's parts are weighted for. `training`: how steps
        clip, which batch each rank passes and what a non-finite step does
        (runtime/training.py); `example_batch`, the global batch of the example."""
        super().__init__()
        if groups.device_type == "cpu":
            keep_freed_memory()  # the step the cost models price (runtime/host_memory.py)
        self.stages = nn.ModuleList(program.stages)
        self.input_shapes = tuple(input_shapes)
        self.dim_ranges = dict(dim_ranges or {})
        self.steps = 0  # training steps begun, for errors that name one
        self.options = training or TrainingOptions()
        self.example_batch = example_batch
        # The global gradient norm of the last step, before clipping (None before one).
        self.grad_norm: float | None = None
        self.skipped_steps = 0  # non-finite steps skipped (skip_nonfinite=True)
        self._norm: GradientNorm | None = None  # built at the first step (collective)
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
        # Eval mode's programs, captured in eval mode on first use (runtime/modes.py).
        self.eval_programs = (
            EvalPrograms(make_program, self.executor, groups) if make_program else None
        )
        self.state = (
            build_data_parallel_state(
                SyncSettings.of(plan),
                program.stages,
                groups.batch_group(),
                optimizer,
                context=ContextSums(groups.group(Axis.DP, Axis.CP), program.cp_summed)
                if program.cp_summed
                else None,
                experts=ExpertShards(
                    groups.group(Axis.DP),
                    program.ep_sharded,
                    groups.batch_size,
                    groups.group(Axis.EP),
                )
                if program.ep_sharded
                else None,
            )
            if optimizer
            else None
        )

    def _executor(self, program: RankProgram, loss_fn: LossFn) -> LocalExecutor | PipelineExecutor:
        loss = StepLoss(loss_fn, self._tp_group).for_program(program)
        if self.plan.pp == 1:
            return LocalExecutor(
                program.stages[0],
                loss,
                self.plan.microbatches,
                self.precision,
                self.options.compile,
            )
        from autopart.runtime.pipeline import PipelineExecutor

        return PipelineExecutor(
            program, self.plan, self.groups, loss, self.precision, self.options.compile
        )

    @property
    def _tp_group(self) -> dist.ProcessGroup | None:
        """The tp group, where there is one (the vocabulary-parallel loss runs over it)."""
        return self.groups.group(Axis.TP) if self.plan.tp > 1 else None

    def _again(self, make_program: MakeProgram) -> Callable[[tuple], ShapedProgram]:
        def again(inputs: tuple) -> ShapedProgram:
            assert self.executor is not None, "programs are made again for train_step only"
            # per-rank stand-ins for the global batch: zeros
            program, shapes, ranges = make_program(filled(inputs, self.groups.device))
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
        """The model's output for this rank's samples (`local_batch`), in the module's
        mode: after `eval()`, the output `model.eval()` gives (runtime/modes.py)."""
        if self.plan.pp > 1:
            raise NotImplementedError(
                "a pipelined model runs through train_step, and evaluate for its loss"
            )
        stage, sharded = self.stages[0], self.vocab_parallel_loss
        if not self.training:
            program = self._eval_programs().first.program
            stage, sharded = program.stages[0], program.vocab_parallel_loss
        args, kwargs = self.precision.model_inputs((args, kwargs))
        with self._weights_16_bit():
            output = stage(*args, **kwargs)
        # The program may return logits sharded over the vocabulary (for the loss's
        # sake); the caller gets them whole.
        return whole_output(output, sharded, self._tp_group)

    def _eval_programs(self) -> EvalPrograms:
        if self.eval_programs is None:
            raise ValueError(
                "eval mode runs the model captured again in eval mode, and this module "
                "cannot capture it: build it with autopart.parallelize"
            )
        return self.eval_programs

    def _weights_16_bit(self) -> contextlib.AbstractContextManager[None]:
        """With master weights on the host the device's weights are 16-bit, which only
        the plan's autocast multiplies with its activations (passes/master_weights.py)."""
        if self.plan.master_weights == MasterWeights.HOST:
            return self.precision.autocast()
        return contextlib.nullcontext()

    @property
    def data_parallel_size(self) -> int:
        """How many shares the global batch is split into (dp × ep): with
        `batch="per_rank"`, a DistributedSampler's `num_replicas`."""
        return self.groups.batch_size

    @property
    def data_parallel_rank(self) -> int:
        """This rank's share of the batch: a DistributedSampler's `rank`. The tensor,
        context and pipeline-parallel ranks of one share have the same."""
        return self.groups.batch_rank

    def local_batch(self, batch: Any) -> Any:
        """This rank's share of a step's batch, on this rank's device: its slice of the
        global batch, or the batch as passed under the per-rank convention."""
        if not self.options.per_rank:
            batch = split_batch(batch, self.groups.batch_rank, self.groups.batch_size)
        device = self.groups.device
        return pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), batch)

    def train_step(self, inputs: Any, target: Any) -> torch.Tensor:
        """Forward, backward, gradient sync, clipping and optimizer step on the batch
        (the global batch, or this rank's share with `batch="per_rank"`); returns the
        global mean loss, the same on every rank, and leaves the global gradient norm
        before clipping in `grad_norm`. Inputs that differ from the example only in
        sizes the capture kept static run a program made for their shapes
        (runtime/programs.py). A step whose loss or gradient norm is not finite is
        skipped: NonFiniteLoss, unless `skip_nonfinite`."""
        if self.programs is None or self.state is None:
            raise ValueError("train_step needs parallelize(..., loss_fn=..., optimizer=...)")
        args = self.precision.model_inputs(inputs if isinstance(inputs, tuple) else (inputs,))
        plan = self.plan
        multiple = sequence_multiple(plan.cp, plan.tp, plan.sequence_parallel)
        executor = self.programs.serving(self._as_global(args), {SEQ: multiple})
        self.steps += 1
        try:
            return self._step(executor, args, target)
        except RuntimeError as e:
            lost = peer_lost(e, self.steps - 1, self.groups.timeout)
            if lost is None:
                raise
            raise lost from e

    def _as_global(self, args: tuple) -> tuple:
        """The global batch whose shapes `args` stand for: under the per-rank convention,
        meta tensors as large as every share together (for the checks and the choice
        of program, which read shapes alone)."""
        if not self.options.per_rank:
            return args
        shares = self.groups.batch_size

        def grown(t: torch.Tensor) -> torch.Tensor:
            shape = (t.shape[0] * shares, *t.shape[1:]) if t.dim() else ()
            return torch.empty(shape, dtype=t.dtype, device="meta")

        return pytree.tree_map_only(torch.Tensor, grown, args)

    def _step(
        self, executor: LocalExecutor | PipelineExecutor, args: tuple, target: Any
    ) -> torch.Tensor:
        assert self.state is not None, "train_step checked it"
        self.state.begin()
        local_loss = executor.run(
            self.local_batch(args), self.local_batch(target), self._loss_shares(target)
        )
        self.state.finish()
        if self._norm is None:
            self._norm = GradientNorm(self)
        sums = self._sum_step(local_loss, self._norm.square_sum(), (args, target))
        self._check_convention(sums, args)
        scaler = self.precision.scaler
        self.grad_norm = math.sqrt(sums.square_sum) / (scaler.value if scaler else 1.0)
        loss = torch.tensor(sums.loss, dtype=torch.float32)
        # Under fp16 an overflowing gradient is the loss scaler's to skip and back off.
        if not is_finite(sums.loss) or (scaler is None and not is_finite(self.grad_norm)):
            return self._skip(loss)
        if not self.precision.unscale(self.state.optimizer):
            return loss
        if self.options.max_grad_norm is not None:
            self._norm.clip_(self.grad_norm, self.options.max_grad_norm)
        self.state.step()
        return loss

    def _loss_shares(self, target: Any) -> list[float]:
        """The weight of each of this rank's microbatches in the step's loss
        (`runtime/loss.py`): under the per-rank convention each rank counts its own
        target's tokens, and the batch group exchanges the counts."""
        dp, rank, m = self.groups.batch_size, self.groups.batch_rank, self.plan.microbatches
        if not self.options.per_rank:
            return shares_of(counted_tokens(self.recognized_loss, target, dp, m), rank, m)
        mine = counted_tokens(self.recognized_loss, target, 1, m)
        if mine is None or dp == 1:
            return shares_of(mine, 0, m)
        local = torch.tensor(mine[0], dtype=torch.int64, device=self.groups.device)
        every = [torch.empty_like(local) for _ in range(dp)]
        dist.all_gather(every, local, group=self.groups.batch_group())
        return shares_of([row.tolist() for row in every], rank, m)

    def _sum_step(self, local_loss: torch.Tensor, square_sum: torch.Tensor, batch: Any) -> StepSums:
        """The global loss, the squared gradient norm and the inputs' agreement, in one
        all-reduce (runtime/step_sums.py)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        contribution = (
            local_loss / self.groups.batch_size
            if self.groups.reports_loss
            else torch.zeros_like(local_loss)
        )
        device = self.groups.device
        per_rank = self.options.per_rank
        share, shares = (self.groups.batch_rank, self.groups.batch_size) if per_rank else (0, 1)
        group = self.groups.group(*MESH_AXES) if world > 1 else None
        return sum_step(contribution, square_sum, input_hashes(batch, device), share, shares, group)

    def _check_convention(self, sums: StepSums, args: tuple) -> None:
        """Raise, on every rank alike, where the inputs break the batch convention."""
        if self.options.per_rank:
            global_sized = self.example_batch in (None, batch_size(args))
            if not sums.agree:
                raise ConventionMismatch(
                    f"step {self.steps}: with batch='per_rank', the tensor, context and "
                    "pipeline-parallel ranks of one data-parallel rank must pass the same "
                    "batch, and some did not. Feed each data-parallel rank its own share "
                    "(DistributedSampler over the data-parallel ranks, "
                    "pm.groups.batch_rank of pm.groups.batch_size)"
                )
            if sums.shares_alike and global_sized:
                raise ConventionMismatch(
                    f"step {self.steps}: with batch='per_rank' every data-parallel rank "
                    "passed the same batch, of the example's global size: each rank would "
                    "train on a copy of it. Pass each rank its own share, or build the "
                    "module with batch='global' (the default) to pass the global batch"
                )
        elif not sums.agree:
            raise ConventionMismatch(
                f"step {self.steps}: the ranks passed different batches, but with "
                "batch='global' (the default) every rank passes the same global batch and "
                "autopart splits it. Pass the global batch on every rank, or build the "
                "module with batch='per_rank' to pass each data-parallel rank its own "
                "share (DDP's convention)"
            )

    def _skip(self, loss: torch.Tensor) -> torch.Tensor:
        """A step with a non-finite loss or gradient: nothing reaches the weights."""
        assert self.grad_norm is not None
        if not self.options.skip_nonfinite:
            raise NonFiniteLoss(self.steps, float(loss), self.grad_norm)
        self.skipped_steps += 1
        return loss

    def evaluate(self, inputs: Any, target: Any) -> torch.Tensor:
        """The global mean loss of `inputs` against `target` (a batch as `train_step`
        takes it), the same on every rank: forward only, no gradient, no optimizer
        step. It runs in the module's mode: after `eval()`, the model's eval-mode loss
        (dropout off, batch normalization on its running statistics). Every plan runs
        it, pipelines included. Collective: every rank calls it."""
        if self.programs is None:
            raise ValueError("evaluate needs parallelize(..., loss_fn=...)")
        args = self.precision.model_inputs(inputs if isinstance(inputs, tuple) else (inputs,))
        plan = self.plan
        multiples = {SEQ: sequence_multiple(plan.cp, plan.tp, plan.sequence_parallel)}
        batch = self._as_global(args)
        executor = (
            self.programs.serving(batch, multiples)
            if self.training
            else self._eval_programs().serving(batch, multiples).executor
        )
        assert executor is not None, "a module with a loss function has its executors"
        local = executor.evaluate(
            self.local_batch(args), self.local_batch(target), self._loss_shares(target)
        )
        return self._global_loss(local)

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
        # An exported graph is fixed in the mode it was captured in (it refuses
        # train()/eval()): the flag picks the program that runs (runtime/modes.py).
        self.training = mode
        return self
