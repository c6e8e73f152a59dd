"""Compressed data-parallel gradient reduction, opt-in (`grad_compression=`): it changes
the math, so the solver never chooses it and the plan says it is on.

    "bf16"              each bucket is all-reduced in bfloat16: half the bytes of fp32
                        gradients, each gradient rounded to 8 bits of mantissa.
    "powersgd:rank=r"   PowerSGD (Vogels, Karimireddy & Jaggi, 2019): each gradient
                        matrix M (n × m, a weight's gradient flattened after its first
                        dim) is all-reduced as two rank-r factors, P = M Q (n × r) and
                        Q = Mᵀ P (m × r) after P is orthonormalized: (n + m) r numbers
                        instead of n m. What the factors miss of this rank's M is kept
                        and added to its next gradient (error feedback), and Q is
                        reused as the next step's start (one power iteration per step).
                        Vectors, and matrices whose smaller side is under r, are
                        all-reduced whole. Where r is a matrix's smaller side, P spans
                        its whole column space and the result is the exact mean (in
                        more bytes than whole: a check of the factors, not a saving).

A `Compression` reduces one bucket: `launch` starts it (in backward, as soon as the
bucket's gradients are accumulated), `wait` completes it, leaving the mean over the
group in the bucket's buffer. PowerSGD's two rounds depend on each other, so its bucket
is reduced in `wait`, after backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from autopart.policy import powersgd_compresses, powersgd_matrix, powersgd_rank


class Compression(Protocol):
    def launch(
        self, buffer: torch.Tensor, params: list[nn.Parameter], offsets: list[int]
    ) -> None: ...

    def wait(self) -> None: ...


class Uncompressed:
    """The sum over the group divided by `divisor` (the group's size: the mean), in the
    gradients' dtype."""

    def __init__(self, group: dist.ProcessGroup, divisor: int | None = None) -> None:
        self.group, self.size = group, divisor or dist.get_world_size(group)
        self.work: dist.Work | None = None

    def launch(self, buffer: torch.Tensor, params: list[nn.Parameter], offsets: list[int]) -> None:
        buffer.div_(self.size)
        self.work = dist.all_reduce(buffer, group=self.group, async_op=True)

    def wait(self) -> None:
        assert self.work is not None, "launched first"
        self.work.wait()


class Bf16:
    """The sum over the group divided by `divisor` (the group's size: the mean), summed
    in bfloat16."""

    def __init__(self, group: dist.ProcessGroup, divisor: int | None = None) -> None:
        self.group, self.size = group, divisor or dist.get_world_size(group)
        self.pending: tuple[torch.Tensor, torch.Tensor, dist.Work] | None = None

    def launch(self, buffer: torch.Tensor, params: list[nn.Parameter], offsets: list[int]) -> None:
        low = (buffer / self.size).to(torch.bfloat16)
        self.pending = (buffer, low, dist.all_reduce(low, group=self.group, async_op=True))

    def wait(self) -> None:
        assert self.pending is not None, "launched first"
        buffer, low, work = self.pending
        work.wait()
        buffer.copy_(low)


@dataclass
class _Factors:
    q: torch.Tensor  # m × r, this step's start
    error: torch.Tensor  # n × m, what the last step's factors missed of this rank's M


@dataclass
class PowerSgd:
    """Rank-`rank` PowerSGD with error feedback over `group`, the sum of the factors'
    product divided by `divisor` (the group's size: the mean); its state per parameter
    lives as long as the training (one instance per bucket)."""

    group: dist.ProcessGroup
    rank: int
    divisor: int | None = None
    factors: dict[int, _Factors] = field(default_factory=dict)
    pending: tuple[torch.Tensor, list[nn.Parameter], list[int]] | None = None

    def launch(self, buffer: torch.Tensor, params: list[nn.Parameter], offsets: list[int]) -> None:
        self.pending = (buffer, params, offsets)

    def wait(self) -> None:
        assert self.pending is not None, "launched first"
        buffer, params, offsets = self.pending
        size = self.divisor or dist.get_world_size(self.group)
        views = [buffer[o : o + p.numel()].view(p.shape) for p, o in zip(params, offsets)]
        low = [i for i, v in enumerate(views) if powersgd_compresses(v.shape, self.rank)]
        whole = [views[i] for i in range(len(views)) if i not in low]
        matrices = [views[i].view(powersgd_matrix(views[i].shape)) for i in low]
        for i, m in zip(low, matrices):
            state = self._state(i, m)
            m.add_(state.error)
            state.error.copy_(m)
        ps = [m @ self.factors[i].q for i, m in zip(low, matrices)]
        _all_reduce_together(ps + whole, self.group)
        ps = [torch.linalg.qr(p).Q for p in ps]
        qs = [m.T @ p for m, p in zip(matrices, ps)]
        _all_reduce_together(qs, self.group)
        for i, m, p, q in zip(low, matrices, ps, qs):
            q.div_(size)
            state = self.factors[i]
            m.copy_(p @ q.T)
            state.error.sub_(m)  # this rank's M (with the last error), less the mean's part
            state.q.copy_(q)
        for v in whole:
            v.div_(size)

    def _state(self, index: int, m: torch.Tensor) -> _Factors:
        if index not in self.factors:
            # The same start on every rank: P's all-reduce adds projections on one basis.
            g = torch.Generator(device=m.device).manual_seed(index)
            q = torch.randn(m.shape[1], self.rank, generator=g, device=m.device, dtype=m.dtype)
            self.factors[index] = _Factors(q, torch.zeros_like(m))
        return self.factors[index]


def make_compression(
    spec: str | None, group: dist.ProcessGroup, divisor: int | None = None
) -> Compression:
    """A new reducer for one bucket: the sum over `group` divided by `divisor`, where
    given (the group's size otherwise), compressed as `spec` says. A group of one rank
    sends nothing, and is not compressed."""
    if spec is None or dist.get_world_size(group) == 1:
        return Uncompressed(group, divisor)
    if spec == "bf16":
        return Bf16(group, divisor)
    return PowerSgd(group, powersgd_rank(spec), divisor)


def _all_reduce_together(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Sum `tensors` over `group` in one all-reduce of their concatenation."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
