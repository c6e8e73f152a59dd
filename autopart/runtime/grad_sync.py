"""Data-parallel gradient synchronization: bucketed all-reduce, overlapped with backward.

Gradients live in flat per-bucket buffers (each `param.grad` is a view into one), so
autograd accumulates straight into the buffer and no copy is made. Buckets follow the
order in which backward produces gradients (the reverse of first use in forward); when
the last gradient of a bucket is accumulated, a post-accumulate-grad hook launches its
all-reduce asynchronously while backward goes on. The first bucket launched also
carries the step's loss, so every rank learns the global loss at no extra collective.

Gradients are pre-divided by the group size, so the sum is the mean over the global
batch, the same gradient a single device computes from the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

DEFAULT_BUCKET_BYTES = 25 * 1024**2
FIRST_BUCKET_BYTES = 1024**2  # small, so communication starts early in backward


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    buffer: torch.Tensor
    offsets: list[int]
    loss_slot: int | None = None  # index of the loss in `buffer`, for the first bucket
    ready: set[int] = field(default_factory=set)  # id() of params whose grad arrived
    work: dist.Work | None = None


class GradientSync:
    """All-reduce-averages the gradients of `params` over `group` during backward."""

    def __init__(
        self,
        params_in_backward_order: list[nn.Parameter],
        group: dist.ProcessGroup,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.buckets = _make_buckets(params_in_backward_order, bucket_bytes)
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

    def begin(self, loss: torch.Tensor) -> None:
        """Before backward: zero the buffers, point the grads at them, stage the loss."""
        for bucket in self.buckets:
            bucket.buffer.zero_()
            bucket.ready.clear()
            bucket.work = None
            for p, offset in zip(bucket.params, bucket.offsets):
                p.grad = bucket.buffer[offset : offset + p.numel()].view_as(p)
        first = self.buckets[0] if self.buckets else None
        if first is not None and first.loss_slot is not None:
            first.buffer[first.loss_slot] = loss.detach().to(first.buffer.dtype)

    def finish(self) -> torch.Tensor | None:
        """After backward: reduce what backward did not reach, wait for all, and return
        the global mean loss. Parameters that got no gradient keep `grad = None`."""
        for bucket in self.buckets:
            if bucket.work is None:
                self._launch(bucket)
        loss = None
        for bucket in self.buckets:
            bucket.work.wait()
            for p in bucket.params:
                if id(p) not in bucket.ready:
                    p.grad = None
            if bucket.loss_slot is not None:
                loss = bucket.buffer[bucket.loss_slot].clone()
        return loss

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        bucket = self._bucket_of[id(p)]
        bucket.ready.add(id(p))
        if len(bucket.ready) == len(bucket.params) and bucket.work is None:
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        bucket.buffer.div_(self.size)
        bucket.work = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)


def _make_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[_Bucket]:
    groups: list[list[nn.Parameter]] = []
    limit = FIRST_BUCKET_BYTES
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
    buckets = []
    for i, group in enumerate(groups):
        offsets, total = [], 0
        for p in group:
            offsets.append(total)
            total += p.numel()
        loss_slot = total if i == 0 else None
        buffer = torch.zeros(total + (i == 0), dtype=group[0].dtype, device=group[0].device)
        buckets.append(_Bucket(group, buffer, offsets, loss_slot))
    return buckets
