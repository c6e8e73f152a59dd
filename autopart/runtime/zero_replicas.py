"""ZeRO-1 and ZeRO-2 for parameters every data-parallel rank holds whole.

The parameters stay the model's own. They are grouped into buckets in the order backward
produces their gradients, as for plain data parallelism, and each bucket is flat-sharded
(flat_buckets.py): the optimizer steps only this rank's slice of each bucket, a copy
held as an nn.Parameter of its own, whose `.grad` is the rank's slice of the averaged
gradients. After the step the updated slices are all-gathered and copied back into the
parameters, so every rank again holds the same whole model.

Stage 1 keeps the gradients whole: they accumulate over all of a step's microbatches
into one flat buffer per bucket (each `param.grad` is a view into it), and a bucket is
reduce-scattered, while backward goes on, when its last gradient has arrived.

Stage 2 does not keep them whole: whenever the gradients of one backward pass have all
arrived in a bucket, they are flattened, reduce-scattered and freed (`param.grad = None`),
and the results summed into the shard's gradient. With several microbatches that is one
reduce-scatter per microbatch: the price of holding only 1/N of the gradients.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from autopart.ops.flat_buckets import FlatLayout, GradientReducer, all_gather_flat
from autopart.ops.params import lower
from autopart.policy import GRAD_BUCKET_BYTES
from autopart.runtime.grad_sync import group_into_buckets


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    layout: FlatLayout
    shard: nn.Parameter
    grads: torch.Tensor | None  # stage 1: the bucket's whole gradients, flat
    arrivals: dict[int, int] = field(default_factory=dict)  # id(param) -> backward passes
    complete: int = 0  # stage 1: parameters whose every backward pass has arrived
    flushes: int = 0  # stage 2: backward passes reduced
    launched: bool = False


class ReplicaShards:
    """Sharded optimizer state (stage 1), and gradients (stage 2), for `params` given in
    the order backward produces their gradients; their gradients summed over `group`
    are divided by `divisor` (the group's size where None: their mean)."""

    def __init__(
        self,
        params: list[nn.Parameter],
        group: dist.ProcessGroup,
        accumulation: int,
        stage: int,
        bucket_bytes: int = GRAD_BUCKET_BYTES,
        divisor: int | None = None,
    ) -> None:
        if stage not in (1, 2):
            raise ValueError(f"ReplicaShards is ZeRO stage 1 or 2, not {stage}")
        self.group = group
        self.accumulation = accumulation
        self.stage = stage
        self.reducer = GradientReducer(group, divisor)
        # 16-bit parameters (`compute_in`): the parameters' dtype, which the updated
        # shards are gathered in, and the dtype gradients are reduced in.
        self.compute_dtype: torch.dtype | None = None
        self.reduce_dtype: torch.dtype | None = None
        # Called with a shard once its gradient is final for the step (ZeRO offload
        # sends it to the host then).
        self.on_final: Callable[[nn.Parameter], None] | None = None
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.buckets = [
            self._bucket(run, rank, size) for run in group_into_buckets(params, bucket_bytes)
        ]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
            for b in self.buckets
            for p in b.params
        ]

    def _bucket(self, params: list[nn.Parameter], rank: int, size: int) -> _Bucket:
        layout = FlatLayout.of(params, size)
        shard = nn.Parameter(layout.shard_of([p.detach() for p in params], rank))
        grads = params[0].new_zeros(layout.padded) if self.stage == 1 else None
        return _Bucket(params, layout, shard, grads)

    @property
    def shards(self) -> list[nn.Parameter]:
        return [b.shard for b in self.buckets]

    def lower(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """Hold the parameters, their shards and gradients in `dtype` (16-bit copies of
        master weights kept elsewhere): the tensors lowered."""
        lowered = lower([t for b in self.buckets for t in (*b.params, b.shard)], dtype)
        for b in self.buckets:
            if b.grads is not None:
                b.grads = b.grads.new_zeros(b.grads.shape, dtype=dtype)
        return lowered

    def compute_in(self, dtype: torch.dtype, reduce_dtype: torch.dtype) -> list[torch.Tensor]:
        """16-bit parameters: the parameters (and stage 1's whole gradients, which are
        their `.grad`) hold `dtype`, the shards stay the fp32 masters the optimizer
        steps; gradients are reduced in `reduce_dtype`, and the updated shards gathered
        in `dtype` (half the bytes). The parameters lowered."""
        self.compute_dtype, self.reduce_dtype = dtype, reduce_dtype
        lowered = lower([p for b in self.buckets for p in b.params], dtype)
        for b in self.buckets:
            if b.grads is not None:
                b.grads = b.grads.new_zeros(b.grads.shape, dtype=dtype)
        return lowered

    def begin(self) -> None:
        for b in self.buckets:
            b.arrivals.clear()
            b.complete = 0
            b.flushes = 0
            b.launched = False
            b.shard.grad = None
            if b.grads is None:
                for p in b.params:
                    p.grad = None
            else:
                b.grads.zero_()
                for p, view in zip(b.params, b.layout.views(b.grads)):
                    p.grad = view

    def finish(self) -> None:
        """Reduce what backward did not reach, and wait for every reduction."""
        for b in self.buckets:
            if b.grads is not None and not b.launched:
                self._launch(b)
            elif b.grads is None and any(p.grad is not None for p in b.params):
                self._flush(b, final=True)
        self.reducer.drain()

    def after_step(self) -> None:
        """Every rank's updated shards, back into the whole parameters (two buckets in
        flight at a time)."""
        in_flight: deque[tuple[_Bucket, torch.Tensor, dist.Work]] = deque()
        for b in self.buckets:
            shard = b.shard.detach()
            if self.compute_dtype is not None:
                shard = shard.to(self.compute_dtype)
            in_flight.append((b, *all_gather_flat(shard, b.layout, self.group, True)))
            if len(in_flight) > 1:
                _copy_back(*in_flight.popleft())
        while in_flight:
            _copy_back(*in_flight.popleft())

    def close(self) -> None:
        """Remove the hooks from the parameters (they belong to the user's model)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        b = self._bucket_of[id(p)]
        arrived = b.arrivals[id(p)] = b.arrivals.get(id(p), 0) + 1
        if b.grads is None:  # stage 2: reduce each backward pass's gradients
            if len(b.arrivals) == len(b.params):
                b.flushes += 1
                self._flush(b, final=b.flushes == self.accumulation)
            return
        if arrived == self.accumulation:
            b.complete += 1
            if b.complete == len(b.params) and not b.launched:
                self._launch(b)

    def _launch(self, b: _Bucket) -> None:
        assert b.grads is not None, "only stage 1 reduces a whole bucket of gradients"
        b.launched = True
        grads = b.grads if self.reduce_dtype is None else b.grads.to(self.reduce_dtype)
        self.reducer.launch(grads, b.shard, self.on_final)

    def _flush(self, b: _Bucket, final: bool) -> None:
        dtype = self.reduce_dtype or b.shard.dtype
        flat = b.layout.flatten([p.grad for p in b.params], like=b.shard.new_empty(0, dtype=dtype))
        for p in b.params:
            p.grad = None
        b.arrivals.clear()
        self.reducer.launch(flat, b.shard, self.on_final if final else None)


def _copy_back(b: _Bucket, flat: torch.Tensor, work: dist.Work) -> None:
    work.wait()
    with torch.no_grad():
        torch._foreach_copy_(tuple(b.params), list(b.layout.views(flat)))
