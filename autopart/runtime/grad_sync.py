"""Data-parallel gradient synchronization: bucketed all-reduce, overlapped with backward.

Gradients live in flat per-bucket buffers (each `param.grad` is a view into one), so
autograd accumulates straight into the buffer and no copy is made. Buckets follow the
order in which backward produces gradients (the reverse of first use in forward); when
the last gradient of a bucket is accumulated, a post-accumulate-grad hook launches its
all-reduce asynchronously while backward goes on. With gradient accumulation
(microbatches) a bucket launches when its gradients have all been accumulated for the
last time.

Gradients are pre-divided by the group size, so the sum is the mean over the global
batch, the same gradient a single device computes from the whole batch. Opt-in
compression (`runtime.grad_compression`: bf16, PowerSGD) reduces a bucket otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import fx, nn

from autopart.ops.params import parameter_readers
from autopart.policy import FIRST_GRAD_BUCKET_BYTES, GRAD_BUCKET_BYTES
from autopart.runtime.grad_compression import Compression, make_compression


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    buffer: torch.Tensor
    offsets: list[int]
    arrivals: dict[int, int] = field(default_factory=dict)  # id(param) -> grads accumulated
    complete: int = 0  # params whose every accumulation has arrived
    reducer: Compression | None = None
    launched: bool = False


class GradientSync:
    """All-reduce-averages the gradients of `params` over `group` during backward (sums
    them and divides by `divisor`, where given)."""

    def __init__(
        self,
        params_in_backward_order: list[nn.Parameter],
        group: dist.ProcessGroup,
        accumulation: int = 1,
        bucket_bytes: int = GRAD_BUCKET_BYTES,
        finish_with_backward: bool = False,
        compression: str | None = None,
        divisor: int | None = None,
    ) -> None:
        """`finish_with_backward`: call `finish` when the backward that produced the
        gradients ends (for callers that do not drive the step themselves);
        `compression`: how buckets are reduced (`grad_compression`), exactly if None;
        `divisor`: what the sum is divided by, where not the group's size (the
        data-parallel replicas, when the group also sums context-parallel parts)."""
        self.group = group
        self.accumulation = accumulation
        self.finish_with_backward = finish_with_backward
        self._finish_queued = False
        self.buckets = _make_buckets(params_in_backward_order, bucket_bytes)
        for bucket in self.buckets:
            bucket.reducer = make_compression(compression, group, divisor)
        self._bucket_of: dict[int, _Bucket] = {}
        self._hooks = []
        for bucket in self.buckets:
            for p in bucket.params:
                self._bucket_of[id(p)] = bucket
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    def close(self) -> None:
        """Remove the hooks from the parameters (they belong to the user's model)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def begin(self) -> None:
        """Before the step's first backward: zero the buffers and point the grads at them."""
        self._finish_queued = False
        for bucket in self.buckets:
            bucket.buffer.zero_()
            bucket.arrivals.clear()
            bucket.complete = 0
            bucket.launched = False
            for p, offset in zip(bucket.params, bucket.offsets):
                p.grad = bucket.buffer[offset : offset + p.numel()].view_as(p)

    def finish(self) -> None:
        """After the last backward: reduce what backward did not reach and wait for all.
        Parameters that got no gradient keep `grad = None`, as on one device."""
        for bucket in self.buckets:
            if not bucket.launched:
                self._launch(bucket)
        for bucket in self.buckets:
            assert bucket.reducer is not None, "every bucket has one"
            bucket.reducer.wait()
            for p in bucket.params:
                if id(p) not in bucket.arrivals:
                    p.grad = None

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if self.finish_with_backward and not self._finish_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self._finish_queued = True
        bucket = self._bucket_of[id(p)]
        arrived = bucket.arrivals[id(p)] = bucket.arrivals.get(id(p), 0) + 1
        if arrived == self.accumulation:
            bucket.complete += 1
            if bucket.complete == len(bucket.params) and not bucket.launched:
                self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        assert bucket.reducer is not None, "every bucket has one"
        bucket.reducer.launch(bucket.buffer, bucket.params, bucket.offsets)
        bucket.launched = True


def _make_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[_Bucket]:
    buckets = []
    for group in group_into_buckets(params, bucket_bytes):
        offsets, total = [], 0
        for p in group:
            offsets.append(total)
            total += p.numel()
        buffer = torch.zeros(total, dtype=group[0].dtype, device=group[0].device)
        buckets.append(_Bucket(group, buffer, offsets))
    return buckets


def group_into_buckets(
    params: list[nn.Parameter], bucket_bytes: int = GRAD_BUCKET_BYTES
) -> list[list[nn.Parameter]]:
    """Consecutive runs of `params` that need a gradient, of one dtype and device, up to
    `bucket_bytes` each (the first only `FIRST_GRAD_BUCKET_BYTES`, so communication starts
    early in backward)."""
    groups: list[list[nn.Parameter]] = []
    limit = FIRST_GRAD_BUCKET_BYTES
    size = 0
    for p in params:
        if not p.requires_grad:
            continue
        new_group = (
            not groups
            or size + p.numel() * p.element_size() > limit
            or (groups[-1][0].dtype, groups[-1][0].device) != (p.dtype, p.device)
        )
        if new_group and groups and groups[-1]:
            limit = bucket_bytes
        if new_group:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += p.numel() * p.element_size()
    return groups


def params_in_backward_order(stages: list[fx.GraphModule]) -> list[nn.Parameter]:
    """Parameters in the order backward produces their gradients: later stages first,
    and within a stage the reverse of first use in forward (unused ones last)."""
    return [p for gm in reversed(stages) for p in _stage_backward_order(gm)]


def _stage_backward_order(gm: fx.GraphModule) -> list[nn.Parameter]:
    readers = parameter_readers(gm)
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    first_use = {fqn: position[nodes[0]] for fqn, nodes in readers.items()}
    named = dict(gm.named_parameters())
    ordered = sorted(named, key=lambda fqn: -first_use.get(fqn, -1))
    used = [fqn for fqn in ordered if fqn in first_use]
    unused = [fqn for fqn in ordered if fqn not in first_use]
    return [named[fqn] for fqn in used + unused]
