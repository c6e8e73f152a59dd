"""Batch normalization over the global batch: what the batch-norm rewrite
(`passes/batch_norm.py`) puts in place of a training-mode `aten.batch_norm` where the
batch is split over replicas.

Each replica holds its part of the batch. In forward, every replica takes its part's
per-channel moments (a two-pass mean and variance, as one device takes them), and one
all-reduce over the replicas sums the parts' counts, sums and sums of squares rebuilt
from those moments, in float64: merging through sums of squares loses digits as
`mean² / var` grows, and float64 keeps that loss far below float32's rounding for any
activation a network normalizes. Every replica then normalizes by the whole batch's
mean and biased variance, and updates its running statistics as one device does: the
mean, and the variance unbiased over the whole batch's count.

In backward, with x̂ the normalized input and g the gradient reaching the norm's output,

    dx = w · invstd · (g − Σg / N − x̂ · Σ(g·x̂) / N)

where the sums run over the whole batch's N values of the channel: one all-reduce of Σg
and Σ(g·x̂) per norm. It is the adjoint of the forward's all-reduce, so each replica's
input gradient is that of the sum of every replica's loss. The weight's and bias's
gradients are this replica's own sums (Σ g·x̂, Σ g): the data-parallel sync sums them
over the replicas as it does every replicated weight's.

With per-part statistics (`per_part_batch_norm`), each replica normalizes its own part,
as DDP without SyncBatchNorm does, and as DDP's broadcast of buffers before each forward
does, starts its running statistics from the first replica's: every replica then holds
what DDP's same rank holds.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.autograd import Function
from torch.distributed import GroupName

# The sums travel in float64 (see the module docstring): 2 per channel forward, and the
# count; 2 per channel backward.
SUM_BYTES = 8


def global_batch_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    momentum: float,
    eps: float,
    group: GroupName,
) -> torch.Tensor:
    """`aten.batch_norm` in training mode on `x` ([N, C, ...], this replica's part of
    the batch), with the statistics of the whole batch over `group`'s replicas."""
    return _GlobalBatchNorm.apply(x, weight, bias, running_mean, running_var, momentum, eps, group)


def per_part_batch_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    momentum: float,
    eps: float,
    group: GroupName,
) -> torch.Tensor:
    """`aten.batch_norm` in training mode on `x`, this replica's part of the batch, by its
    own statistics, its running statistics first overwritten by those of `group`'s
    first replica (DDP's `broadcast_buffers`)."""
    _from_first_replica([t for t in (running_mean, running_var) if t is not None], group)
    return F.batch_norm(x, running_mean, running_var, weight, bias, True, momentum, eps)


def _from_first_replica(buffers: list[torch.Tensor], group: GroupName) -> None:
    """Overwrite `buffers` in place by the first rank of `group`'s: one broadcast."""
    if not buffers:
        return
    with torch.no_grad():
        flat = torch.cat([b.reshape(-1) for b in buffers])
        pg = dist.distributed_c10d._resolve_process_group(group)
        dist.broadcast(flat, group=pg, group_src=0)
        for b, part in zip(buffers, flat.split([b.numel() for b in buffers]), strict=True):
            b.copy_(part.view_as(b))


def first_replica_bytes(channels: int, itemsize: int) -> int:
    """Bytes the first replica broadcasts per norm with per-part statistics."""
    return 2 * channels * itemsize


def forward_sum_bytes(channels: int) -> int:
    """Bytes each replica all-reduces in a norm's forward: count, sums, sums of squares."""
    return SUM_BYTES * (2 * channels + 1)


def backward_sum_bytes(channels: int) -> int:
    """Bytes each replica all-reduces in a norm's backward: Σg and Σ(g·x̂)."""
    return SUM_BYTES * 2 * channels


class _GlobalBatchNorm(Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        momentum: float,
        eps: float,
        group: GroupName,
    ) -> torch.Tensor:
        x32 = _widened(x)
        dims = _reduced_dims(x)
        count, mean, var = _global_moments(x32, dims, group)
        invstd = torch.rsqrt(var + eps)
        _update_running(running_mean, running_var, mean, var, count, momentum)
        out = (x32 - _per_channel(mean, x)) * _per_channel(_scaled(invstd, weight), x)
        if bias is not None:
            out = out + _per_channel(bias, x)
        ctx.save_for_backward(x, weight, mean, invstd, count)
        ctx.group, ctx.bias_dtype = group, None if bias is None else bias.dtype
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, weight, mean, invstd, count = ctx.saved_tensors
        dims = _reduced_dims(x)
        g = _widened(grad)
        xhat = (_widened(x) - _per_channel(mean, x)) * _per_channel(invstd, x)
        own = torch.stack(
            [g.sum(dims, dtype=torch.float64), (g * xhat).sum(dims, dtype=torch.float64)]
        )
        grad_weight = own[1].to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_bias = own[0].to(ctx.bias_dtype) if ctx.needs_input_grad[2] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            whole = _summed(own, ctx.group) / count
            mean_g, mean_gx = (_per_channel(s.to(g.dtype), x) for s in whole)
            grad_x = (g - mean_g - xhat * mean_gx) * _per_channel(_scaled(invstd, weight), x)
            grad_x = grad_x.to(x.dtype)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


def _global_moments(
    x: torch.Tensor, dims: list[int], group: GroupName
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(count, mean, biased variance) per channel of the whole batch, `x` being this
    replica's part: one all-reduce of [sums, sums of squares, count]. The count stays a
    tensor: reading it would wait for the device."""
    var, mean = torch.var_mean(x, dim=dims, correction=0)
    n = x.numel() // x.shape[1]
    mean64 = mean.to(torch.float64)
    sums = torch.cat(
        [
            mean64 * n,
            (var.to(torch.float64) + mean64.square()) * n,
            mean64.new_full((1,), float(n)),
        ]
    )
    total = _summed(sums, group)
    channels = x.shape[1]
    count = total[-1]
    whole_mean = total[:channels] / count
    whole_var = (total[channels : 2 * channels] / count - whole_mean.square()).clamp_min(0.0)
    return count, whole_mean.to(x.dtype), whole_var.to(x.dtype)


def _update_running(
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    mean: torch.Tensor,
    var: torch.Tensor,
    count: torch.Tensor,
    momentum: float,
) -> None:
    """The running statistics' update one device makes on the whole batch: its variance
    unbiased over the whole batch's count."""
    with torch.no_grad():
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            unbiased = var * (count / (count - 1).clamp_min(1.0)).to(var.dtype)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)


def _summed(x: torch.Tensor, group: GroupName) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", group))


def _widened(x: torch.Tensor) -> torch.Tensor:
    """`x` in at least float32: statistics of 16-bit activations are taken in float32."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _reduced_dims(x: torch.Tensor) -> list[int]:
    """Every dim but the channels' (dim 1)."""
    return [0, *range(2, x.dim())]


def _per_channel(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A per-channel vector shaped to broadcast over `x`'s dim 1."""
    return v.reshape(1, -1, *([1] * (x.dim() - 2)))


def _scaled(invstd: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    return invstd if weight is None else invstd * weight
