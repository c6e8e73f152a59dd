"""Flat buckets: what ZeRO shards over the data-parallel ranks.

A bucket's tensors (parameters, or their gradients) are laid end to end in one flat
buffer, padded to a multiple of the group size N, so that one all-gather or one
reduce-scatter moves the whole bucket and rank r owns the contiguous slice
[r·S, (r + 1)·S) with S = padded / N. Padding elements are zero; elementwise optimizers
(SGD, Adam, AdamW) keep them zero.

`GradientReducer` reduce-scatters flat gradient buckets asynchronously, so backward goes
on while they travel, and accumulates each result into its shard's `.grad`. A bucket
is reduced in the dtype of its flat gradients, which need not be the shard's: with
16-bit parameters the shards are fp32 masters and the gradients are widened before the
reduction, or reduced in 16 bits (`reduce_dtype`), as FSDP2 does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, overload

import torch
import torch.distributed as dist
from torch import nn

# Reduce-scatters in flight at once: enough to overlap with backward, few enough that
# their flat gradients do not pile up.
REDUCE_DEPTH = 2


@dataclass(frozen=True, slots=True)
class FlatLayout:
    """Where each tensor of a bucket lies in its flat buffer."""

    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    padded: int  # the flat buffer's length: a multiple of the group size
    parts: int  # the group size N

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], parts: int) -> FlatLayout:
        offsets, total = [], 0
        for t in tensors:
            offsets.append(total)
            total += t.numel()
        padded = -(-total // parts) * parts
        return cls(tuple(t.shape for t in tensors), tuple(offsets), padded, parts)

    @property
    def numel(self) -> int:
        """Elements of the bucket's tensors, without the padding."""
        return self.offsets[-1] + self.shapes[-1].numel() if self.shapes else 0

    @property
    def shard_numel(self) -> int:
        return self.padded // self.parts

    def shard_slice(self, rank: int) -> slice:
        return slice(rank * self.shard_numel, (rank + 1) * self.shard_numel)

    def flatten(self, tensors: Sequence[torch.Tensor | None], like: torch.Tensor) -> torch.Tensor:
        """One padded flat tensor of `tensors` (None stands for zeros), a new buffer."""
        flat = like.new_empty(self.padded)
        flat[self.numel :].zero_()
        for t, view in zip(tensors, self.views(flat)):
            if t is None:
                view.zero_()
            else:
                view.copy_(t)
        return flat

    def shard_of(self, tensors: Sequence[torch.Tensor], rank: int) -> torch.Tensor:
        """Rank `rank`'s slice of `tensors` flattened, in memory of its own."""
        return self.flatten(tensors, tensors[0])[self.shard_slice(rank)].clone()

    def views(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each tensor of the bucket as a view into `flat`."""
        return tuple(
            flat[offset : offset + shape.numel()].view(shape)
            for offset, shape in zip(self.offsets, self.shapes)
        )


@overload
def all_gather_flat(
    shard: torch.Tensor,
    layout: FlatLayout,
    group: dist.ProcessGroup,
    async_op: Literal[False] = False,
) -> tuple[torch.Tensor, None]: ...


@overload
def all_gather_flat(
    shard: torch.Tensor, layout: FlatLayout, group: dist.ProcessGroup, async_op: Literal[True]
) -> tuple[torch.Tensor, dist.Work]: ...


def all_gather_flat(
    shard: torch.Tensor, layout: FlatLayout, group: dist.ProcessGroup, async_op: bool = False
) -> tuple[torch.Tensor, dist.Work | None]:
    """The whole flat buffer from every rank's shard (filled once the work completes)."""
    flat = shard.new_empty(layout.padded)
    work = dist.all_gather_single(flat, shard.detach(), group=group, async_op=async_op)
    return flat, work


@dataclass(frozen=True, slots=True)
class _Reduction:
    work: dist.Work
    out: torch.Tensor
    flat: torch.Tensor  # held until the reduction is done
    shard: nn.Parameter
    then: Callable[[nn.Parameter], None] | None


class GradientReducer:
    """Averages flat gradient buckets over `group` into the shards each rank owns."""

    def __init__(self, group: dist.ProcessGroup, divisor: int | None = None) -> None:
        """`divisor`: what the summed gradients are divided by; the group's size (their
        mean over it) unless given (expert shards: the batch's shares, `ExpertShards`)."""
        self.group = group
        self.size = dist.get_world_size(group)
        self.divisor = divisor or self.size
        self._pending: deque[_Reduction] = deque()

    def launch(
        self,
        flat: torch.Tensor,
        shard: nn.Parameter,
        then: Callable[[nn.Parameter], None] | None = None,
    ) -> None:
        """Start reducing `flat` (consumed: divided in place) into `shard.grad`; `then`
        is called with the shard once its gradient holds the result."""
        flat.div_(self.divisor)  # a sum of pre-divided gradients is the mean over the batch
        out = flat.new_empty(flat.numel() // self.size)
        work = dist.reduce_scatter_single(out, flat, group=self.group, async_op=True)
        self._pending.append(_Reduction(work, out, flat, shard, then))
        while len(self._pending) > REDUCE_DEPTH:
            self._complete()

    def drain(self) -> None:
        """Wait for every reduction launched; their shards' `.grad` are then complete."""
        while self._pending:
            self._complete()

    def _complete(self) -> None:
        done = self._pending.popleft()  # the flat input is released here
        done.work.wait()
        shard = done.shard
        # Reduced in another dtype than the shard's (16-bit parameters' fp32 masters
        # take gradients reduced in 16 bits, widened here).
        out = done.out.to(shard.dtype)
        if shard.grad is None:
            shard.grad = out
        else:
            shard.grad.add_(out)
        if done.then is not None:
            done.then(shard)
