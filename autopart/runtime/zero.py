"""ZeRO stages 1-3 as a `DataParallelState` (runtime/data_parallel.py).

Whatever the stage, the optimizer the user asked for steps flat shards of the
parameters, one per bucket (flat_buckets.py), each this rank's 1/N of the bucket; they
are the only parameters it sees, and their `.grad` is the rank's slice of the gradients
averaged over the data-parallel group. Where those shards come from is a `ShardedPart`:

    ReplicaShards       parameters held whole on every rank (zero_replicas.py): stage 1
                        shards the optimizer state, stage 2 the gradients too
    OwnedParameters     the same by whole parameters, each stepped by its owner
                        (zero_owners.py), for optimizers not known to be elementwise
    ShardedParameters   ZeRO-3's shards, made by zero3_pass and held by each stage
                        module (zero3.py)

Under ZeRO-3, parameters the pass leaves whole (a pipeline's tied weights) are trained
as under ZeRO-2. Flat shards are exact only for elementwise optimizers
(`policy.ELEMENTWISE_OPTIMIZERS`): any other steps whole parameters at stages 1 and 2,
and ZeRO-3 is refused for it (`policy.zero_refusal`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
import torch.distributed as dist
from torch import fx, nn

from autopart.ops.params import parameter_attributes, parameters_named
from autopart.ops.zero3 import ShardedParameters, sharded_parameters
from autopart.policy import ELEMENTWISE_OPTIMIZERS, GRAD_BUCKET_BYTES, optimizer_class
from autopart.runtime.dp_types import ExpertShards, OptimizerFactory, SyncSettings
from autopart.runtime.grad_sync import params_in_backward_order
from autopart.runtime.offload import HostOptimizer
from autopart.runtime.zero_owners import OwnedParameters
from autopart.runtime.zero_replicas import ReplicaShards


class ShardedPart(Protocol):
    """Flat shards for the optimizer, and their gradients through a step."""

    @property
    def shards(self) -> Iterable[nn.Parameter]: ...

    def lower(self, dtype: torch.dtype) -> list[torch.Tensor]: ...

    def begin(self) -> None: ...

    def finish(self) -> None: ...

    def after_step(self) -> None: ...

    def close(self) -> None: ...


class ZeroState:
    """ZeRO stage 1, 2 or 3: one optimizer over the shards of every part. With
    `offload`, the optimizer steps host copies of the shards (`HostOptimizer`): each
    shard's gradient goes down as its last reduction lands (ZeRO-1/2's buckets; ZeRO-3's
    once backward is over), the step runs there, and the updated values come back before
    the parts gather them; the optimizer's state never touches the device. With
    `masters_dtype` too, the host copies are the fp32 master weights and the parts hold
    copies in that 16-bit dtype."""

    def __init__(
        self,
        parts: list[ShardedPart],
        optimizer: OptimizerFactory,
        offload: bool = False,
        masters_dtype: torch.dtype | None = None,
    ) -> None:
        self.parts = parts
        self.shards = [s for part in parts for s in part.shards]
        self.offloaded = HostOptimizer(self.shards, optimizer) if offload else None
        if self.offloaded is not None and masters_dtype is not None:
            self.offloaded.lowered = {id(t): t for part in parts for t in part.lower(masters_dtype)}
        if self.offloaded is not None:
            for part in parts:
                if isinstance(part, ReplicaShards):
                    part.on_final = self.offloaded.send_down
        self.optimizer = (
            self.offloaded.optimizer if self.offloaded is not None else optimizer(self.shards)
        )

    def begin(self) -> None:
        if self.offloaded is not None:
            self.offloaded.begin()
        for part in self.parts:
            part.begin()

    def finish(self) -> None:
        for part in self.parts:
            part.finish()
        if self.offloaded is not None:
            self.offloaded.all_down()

    def step(self) -> None:
        if self.offloaded is None:
            self.optimizer.step()
        else:
            self.offloaded.step()
            self.offloaded.wait_up()
        for part in self.parts:
            part.after_step()

    def close(self) -> None:
        for part in self.parts:
            part.close()
        if self.offloaded is not None:
            self.offloaded.widen_back()


def zero_state(
    settings: SyncSettings,
    stages: list[fx.GraphModule],
    group: dist.ProcessGroup,
    optimizer: OptimizerFactory,
    experts: ExpertShards | None = None,
) -> ZeroState:
    """ZeRO stage `settings.zero` (1-3) for this rank's `stages` over the data-parallel
    `group`, its optimizer state on the host where `settings.offload` (and the fp32
    master weights, the device holding `masters_dtype` copies, where that is given). Under expert
    parallelism (`group` is dp × ep) the experts' shards are another part, over the dp
    replicas of the same experts (`experts.group`), their summed gradients divided by
    the batch's shares as the rest are averaged over them; at stage 3 the stages'
    `ShardedParameters` hold both kinds of bucket, each over its own group."""
    zero, accumulation, masters_dtype = settings.zero, settings.accumulation, settings.masters_dtype
    elementwise = optimizer_class(optimizer) in ELEMENTWISE_OPTIMIZERS
    if settings.param_dtype is not None and not elementwise:
        known = ", ".join(sorted(o.__name__ for o in ELEMENTWISE_OPTIMIZERS))
        raise ValueError(
            "precision='bf16-params' steps fp32 masters as flat ZeRO shards, which only an "
            f"elementwise optimizer ({known}) steps as on one device: use one of those, or "
            "precision='bf16-mixed'"
        )
    whole = _trained_in_backward_order(stages)
    parts: list[ShardedPart] = []
    if zero == 3:
        parts = [z for gm in reversed(stages) if (z := sharded_parameters(gm)) is not None]
    split = parameters_named(stages, experts.fqns) if experts else set()
    runs: list[tuple[list[nn.Parameter], dist.ProcessGroup, int | None]] = [
        ([p for p in whole if id(p) not in split], group, None)
    ]
    if experts is not None:
        runs.append(([p for p in whole if id(p) in split], experts.group, experts.shares))
    for params, over, divisor in runs:
        if not params:
            continue
        if elementwise:
            # Bucketed by their fp32 bytes now, and as big in their 16-bit gradients
            # once lowered.
            widening = 4 // masters_dtype.itemsize if masters_dtype is not None else 1
            bucket_bytes = GRAD_BUCKET_BYTES * widening
            parts.append(
                ReplicaShards(params, over, accumulation, min(zero, 2), bucket_bytes, divisor)
            )
        else:
            parts.append(OwnedParameters(params, over, accumulation, min(zero, 2), divisor))
    if settings.param_dtype is not None:
        for part in parts:  # elementwise: no OwnedParameters
            assert isinstance(part, ShardedParameters | ReplicaShards)
            part.compute_in(settings.param_dtype, settings.reduce_dtype)
    return ZeroState(parts, optimizer, settings.offload, masters_dtype)


def _trained_in_backward_order(stages: list[fx.GraphModule]) -> list[nn.Parameter]:
    """The stages' own parameters that the graph reads and that need a gradient: one
    read nowhere never gets one, and is not stepped, as on one device."""
    read = {id(p) for gm in stages for _, p in parameter_attributes(gm)}
    return [p for p in params_in_backward_order(stages) if p.requires_grad and id(p) in read]
