"""Gradients and optimizer state across the data-parallel axis, by ZeRO stage.

A `DataParallelState` owns what happens to the gradients of this rank's parameters and
how the optimizer steps them:

    begin()   before the step's first backward
    finish()  after its last backward: gradients synchronized (waits)
    step()    the optimizer step, and whatever must follow it (ZeRO's parameter gather)
    close()   remove every hook autopart put on the model's parameters

Stage 0 (here) keeps a full replica of everything and all-reduces the gradients;
stages 1-3 shard optimizer state, gradients and parameters (runtime/zero.py). Local SGD
(here, opt-in) keeps full replicas too but averages parameters instead, every few steps.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.algorithms.model_averaging.utils import average_parameters

from autopart.ops.params import lower, parameters_named
from autopart.policy import OuterOptimizer
from autopart.runtime.dp_types import ContextSums, ExpertShards, OptimizerFactory, SyncSettings
from autopart.runtime.grad_sync import GradientSync, params_in_backward_order
from autopart.runtime.offload import HostOptimizer
from autopart.runtime.zero import zero_state


class DataParallelState(Protocol):
    optimizer: torch.optim.Optimizer
    offloaded: HostOptimizer | None  # ZeRO offload's host copies, which the optimizer steps

    def begin(self) -> None: ...

    def finish(self) -> None: ...

    def step(self) -> None: ...

    def close(self) -> None: ...


class LocalState:
    """A data-parallel axis of one rank: nothing to synchronize. With `offload`, the
    optimizer steps host copies of the parameters (`HostOptimizer`): each parameter's
    gradient goes down once its last backward pass of the step (of `accumulation`)
    has produced it; with `masters_dtype` too, the host copies are the fp32 master
    weights and the trained parameters hold copies in that 16-bit dtype. With
    `param_dtype` (16-bit parameters) the optimizer steps fp32 copies on the device,
    and every floating parameter holds its `param_dtype` copy."""

    def __init__(
        self,
        stages: list[fx.GraphModule],
        optimizer: OptimizerFactory,
        offload: bool = False,
        accumulation: int = 1,
        masters_dtype: torch.dtype | None = None,
        param_dtype: torch.dtype | None = None,
    ) -> None:
        self.params = list(dict.fromkeys(p for gm in stages for p in gm.parameters()))
        copies = offload or param_dtype is not None
        self.offloaded = (
            HostOptimizer(self.params, optimizer, on_device=not offload) if copies else None
        )
        self.optimizer = (
            self.offloaded.optimizer if self.offloaded is not None else optimizer(self.params)
        )
        self.accumulation = accumulation
        self._arrivals: dict[int, int] = {}
        self._active = False  # between begin and finish: the hooks count arrivals
        trained = [p for p in self.params if p.requires_grad] if offload else []
        if self.offloaded is not None and masters_dtype is not None:
            self.offloaded.lowered = {id(p): p for p in lower(trained, masters_dtype)}
        if self.offloaded is not None and param_dtype is not None:
            floating = [p for p in self.params if p.is_floating_point()]
            self.offloaded.lowered = {id(p): p for p in lower(floating, param_dtype)}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in trained]

    def begin(self) -> None:
        if self.offloaded is None:
            self.optimizer.zero_grad(set_to_none=True)
            return
        self.offloaded.begin()  # the host's gradients
        for p in self.params:
            p.grad = None
        self._arrivals.clear()
        self._active = True

    def finish(self) -> None:
        if self.offloaded is not None:
            self._active = False
            self.offloaded.all_down()

    def step(self) -> None:
        if self.offloaded is None:
            self.optimizer.step()
            return
        self.offloaded.step()
        self.offloaded.wait_up()

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self.offloaded is not None:
            self.offloaded.widen_back()

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self._active:  # a backward outside a step: not this step's gradient
            return
        arrived = self._arrivals[id(p)] = self._arrivals.get(id(p), 0) + 1
        if arrived == self.accumulation and self.offloaded is not None:
            self.offloaded.send_down(p)


class ReplicatedState:
    """ZeRO stage 0: plain data parallelism (its gradients compressed, if asked), its
    gradients synchronized as `exact_syncs` says."""

    offloaded: HostOptimizer | None = None

    def __init__(
        self,
        stages: list[fx.GraphModule],
        group: dist.ProcessGroup,
        optimizer: OptimizerFactory,
        accumulation: int,
        compression: str | None = None,
        context: ContextSums | None = None,
        experts: ExpertShards | None = None,
    ) -> None:
        self.syncs = exact_syncs(stages, group, accumulation, compression, context, experts)
        self.optimizer = optimizer([p for gm in stages for p in gm.parameters()])

    def begin(self) -> None:
        for sync in self.syncs:
            sync.begin()

    def finish(self) -> None:
        for sync in self.syncs:
            sync.finish()

    def step(self) -> None:
        self.optimizer.step()

    def close(self) -> None:
        for sync in self.syncs:
            sync.close()


def exact_syncs(
    stages: list[fx.GraphModule],
    group: dist.ProcessGroup,
    accumulation: int,
    compression: str | None = None,
    context: ContextSums | None = None,
    experts: ExpertShards | None = None,
) -> list[GradientSync]:
    """Every gradient of `stages` made the mean over the global batch: averaged over
    `group`, but, under context parallelism, those of `context.fqns` summed over dp × cp
    and divided by the dp replicas (each cp rank holds a part); under expert parallelism
    (`group` is then dp × ep), the experts' summed over their dp replicas and divided by
    the batch's shares. `compression` compresses every all-reduce (cp sums its parts
    in the graph when it is set: `policy.cp_gradients_in_sync`)."""
    params = params_in_backward_order(stages)
    summed = parameters_named(stages, context.fqns) if context else set()
    split = parameters_named(stages, experts.fqns) if experts else set()
    rest = [p for p in params if id(p) not in summed | split]
    syncs = [GradientSync(rest, group, accumulation, compression=compression)]
    if context is not None:
        parts = [p for p in params if id(p) in summed]
        dp = dist.get_world_size(group)
        syncs.append(GradientSync(parts, context.group, accumulation, divisor=dp))
    if experts is not None:
        shards = [p for p in params if id(p) in split]
        syncs.append(
            GradientSync(
                shards, experts.group, accumulation, compression=compression, divisor=experts.shares
            )
        )
    return syncs


class LocalSgdState:
    """Local SGD, after a warm-up of plain data parallelism (post-local-SGD): for
    `warmup` steps the gradients are all-reduced; from then on every replica steps on
    its own gradients, and the replicas average their parameters after every `every`-th
    local step. With `every` = 1 and SGD (with or without momentum: both are linear in
    the gradients) it is plain data parallelism, up to reduction order; otherwise the
    math differs from one device, as the user asked.

    Under expert parallelism a replica is an ep group (`experts.replica`), whose ranks
    split its batch and its experts: each local step averages the other weights'
    gradients over those ranks and divides the experts' (which already sum every ep
    rank's tokens) by their count, as one replica's loss on its whole batch gives them;
    the replicas (`experts.group`, the dp ranks that hold the same experts) average.

    With an `outer` optimizer (DiLoCo's form), the parameters held since the last
    averaging (the anchor, the same on every replica) take an SGD step on their
    difference from the replicas' mean, and every replica goes on from the anchor."""

    offloaded: HostOptimizer | None = None

    def __init__(
        self,
        stages: list[fx.GraphModule],
        group: dist.ProcessGroup,
        optimizer: OptimizerFactory,
        accumulation: int,
        every: int,
        warmup: int,
        outer: OuterOptimizer | None = None,
        experts: ExpertShards | None = None,
    ) -> None:
        self.stages, self.accumulation, self.experts = stages, accumulation, experts
        self.params = list(dict.fromkeys(p for gm in stages for p in gm.parameters()))
        split = parameters_named(stages, experts.fqns) if experts is not None else set()
        self.expert_params = [p for p in self.params if id(p) in split]
        self.optimizer = optimizer(self.params)
        self.replicas = experts.group if experts is not None else group
        self.every, self.warmup = every, warmup
        self.outer = outer
        self.anchor: list[torch.Tensor] = []
        self.outer_step: torch.optim.Optimizer | None = None
        self.syncs = exact_syncs(stages, group, accumulation, experts=experts) if warmup else []
        self.steps = 0

    def begin(self) -> None:
        if self.steps == self.warmup:  # the warm-up is over: local steps from here on
            for sync in self.syncs:
                sync.close()
            self.syncs = self._replica_syncs()
            if self.outer is not None:
                self._hold_anchor()
        self.optimizer.zero_grad(set_to_none=True)
        for sync in self.syncs:
            sync.begin()

    def finish(self) -> None:
        for sync in self.syncs:
            sync.finish()
        if self.experts is not None and self.steps >= self.warmup:
            ep = dist.get_world_size(self.experts.replica)
            for p in self.expert_params:
                if p.grad is not None:
                    p.grad.div_(ep)

    def step(self) -> None:
        self.optimizer.step()
        self.steps += 1
        local = self.steps - self.warmup
        # A stage without parameters of its own (its weights all tied to an earlier
        # stage's, whose owner averages them) has nothing to average, nor have its
        # replicas, which run the same stage.
        if local > 0 and local % self.every == 0 and self.params:
            average_parameters(iter(self.params), self.replicas)
            if self.outer_step is not None:
                self._step_anchor()

    def _replica_syncs(self) -> list[GradientSync]:
        """A local step's gradient sync: within an ep replica, the other weights' mean
        over its ranks; without ep, none."""
        if self.experts is None:
            return []
        split = {id(p) for p in self.expert_params}
        rest = [p for p in params_in_backward_order(self.stages) if id(p) not in split]
        return [GradientSync(rest, self.experts.replica, self.accumulation)]

    def _hold_anchor(self) -> None:
        """The parameters every replica starts its local steps from, and the outer
        optimizer over them."""
        assert self.outer is not None
        if not self.params:  # nothing to average (see `step`): no outer step either
            return
        self.anchor = [p.detach().clone() for p in self.params]
        outer = self.outer
        self.outer_step = torch.optim.SGD(
            self.anchor, lr=outer.lr, momentum=outer.momentum, nesterov=outer.nesterov
        )

    @torch.no_grad()
    def _step_anchor(self) -> None:
        """The outer step: the anchor moves by SGD on (anchor − the replicas' mean),
        and every replica goes on from it."""
        assert self.outer_step is not None
        for anchor, p in zip(self.anchor, self.params):
            anchor.grad = anchor - p
        self.outer_step.step()
        for anchor, p in zip(self.anchor, self.params):
            p.copy_(anchor)

    def close(self) -> None:
        for sync in self.syncs:
            sync.close()


def build_data_parallel_state(
    settings: SyncSettings,
    stages: list[fx.GraphModule],
    group: dist.ProcessGroup,
    optimizer: OptimizerFactory,
    *,
    context: ContextSums | None = None,
    experts: ExpertShards | None = None,
) -> DataParallelState:
    """The state `settings` (the plan's dp axis) ask for, over this rank's `stages` and
    the data-parallel `group`; `context`, the gradients the sync also sums over cp;
    `experts`, the expert shards synced over their dp replicas only (`group` is then
    dp × ep)."""
    optimizer = _allowing_no_parameters(optimizer, _device_of(stages))
    state = _state_for(settings, stages, group, optimizer, context, experts)
    if settings.param_dtype is not None:
        _lower_the_rest(stages, state, settings.param_dtype)
    return state


def _state_for(
    s: SyncSettings,
    stages: list[fx.GraphModule],
    group: dist.ProcessGroup,
    optimizer: OptimizerFactory,
    context: ContextSums | None,
    experts: ExpertShards | None,
) -> DataParallelState:
    if experts is not None and s.zero:
        return zero_state(s, stages, group, optimizer, experts)
    if context is not None and context.fqns:  # plain data parallelism (cp_gradients_in_sync)
        return ReplicatedState(stages, group, optimizer, s.accumulation, None, context, experts)
    if dist.get_world_size(group) == 1:
        return LocalState(
            stages, optimizer, s.offload, s.accumulation, s.masters_dtype, s.param_dtype
        )
    if s.sync_every is not None:
        return LocalSgdState(
            stages, group, optimizer, s.accumulation, s.sync_every, s.sync_warmup, s.outer, experts
        )
    if s.zero == 0:
        return ReplicatedState(
            stages, group, optimizer, s.accumulation, s.compression, None, experts
        )
    return zero_state(s, stages, group, optimizer)


def _lower_the_rest(
    stages: list[fx.GraphModule], state: DataParallelState, dtype: torch.dtype
) -> None:
    """16-bit parameters: the floating parameters no part of `state` steps (frozen ones)
    hold `dtype` too, as the graph captured in it reads them; the fp32 masters the
    optimizer steps (ZeRO-3's shards are the stages' own parameters) stay as they are."""
    masters = {id(p) for group in state.optimizer.param_groups for p in group["params"]}
    lower(
        [
            p
            for gm in stages
            for p in gm.parameters()
            if p.is_floating_point() and p.dtype != dtype and id(p) not in masters
        ],
        dtype,
    )


def _allowing_no_parameters(optimizer: OptimizerFactory, device: torch.device) -> OptimizerFactory:
    """`optimizer`, also over no parameters, which torch's optimizers refuse: a pipeline
    stage whose weights are all tied to an earlier stage's (a tied head alone in the
    last stage) holds replicas of them (buffers, `runtime/shared_params.py`) and no
    parameters of its own. It gets the user's optimizer built over a placeholder, then
    emptied: its parameter groups' settings are every other rank's (for schedulers and
    checkpoints), and its step changes nothing. The rank still takes part in every
    collective of the step: its replicas' gradients go to their owner, and the state's
    syncs, the loss's all-reduce and the loss scaler's check run over empty lists."""

    def build(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        params = list(params)
        if params:
            return optimizer(params)
        built = optimizer([nn.Parameter(torch.zeros((), device=device))])
        for group in built.param_groups:
            group["params"] = []
        built.state.clear()
        return built

    return build


def _device_of(stages: list[fx.GraphModule]) -> torch.device:
    """Where `stages` hold their tensors (the placeholder parameter's device)."""
    for gm in stages:
        for t in (*gm.parameters(), *gm.buffers()):
            return t.device
    return torch.device("cpu")
