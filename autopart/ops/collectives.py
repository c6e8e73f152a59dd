"""Autograd-aware collectives, the targets of the nodes rewrite passes insert.

Each is a plain function of tensors, a tensor dim and a process-group name, so it prints
readably in the per-rank graph and runs eagerly under autograd. They come in pairs
whose forward and backward are adjoint under the tensor-parallel invariants (an `R`
tensor is identical on every rank of the group, and so is its gradient):

    function          forward               backward             use
    copy_to_group     identity              all-reduce (sum)     R input of a column-parallel op
    all_reduce        all-reduce (sum)      identity             P output of a row-parallel op
    all_gather        gather along dim      keep own slice       S -> R for a replicated consumer
    shard             keep own slice        gather along dim     R -> S
    reduce_scatter    reduce-scatter (sum)  gather along dim     P -> S (sequence parallel)
    gather_for_grad   gather along dim      reduce-scatter       S -> R before a column op (SP)
    all_to_all        S(a) -> S(b)          S(b) -> S(a)

The collectives are PyTorch's functional collectives; groups are named as
`ProcessGroup.group_name`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.autograd import Function
from torch.distributed import GroupName


def _all_reduce(x: torch.Tensor, group: GroupName) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", group))


def _all_gather(x: torch.Tensor, dim: int, group: GroupName) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_gather_single(x.contiguous(), dim, group))


def _reduce_scatter(x: torch.Tensor, dim: int, group: GroupName) -> torch.Tensor:
    return funcol.wait_tensor(funcol.reduce_scatter_single(x.contiguous(), "sum", dim, group))


def _own_slice(x: torch.Tensor, dim: int, group: GroupName) -> torch.Tensor:
    pg = _resolve(group)
    size, rank = dist.get_world_size(pg), dist.get_rank(pg)
    return x.chunk(size, dim)[rank].contiguous()


def _resolve(group: GroupName) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(group)


class _CopyToGroup(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: GroupName) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _all_reduce(grad, ctx.group), None


class _AllReduce(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: GroupName) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, None


class _AllGather(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: GroupName) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _own_slice(grad, ctx.dim, ctx.group), None, None


class _Shard(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: GroupName) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _own_slice(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _ReduceScatter(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: GroupName) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _GatherForGrad(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: GroupName) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _AllToAll(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, split_dim: int, cat_dim: int, group: GroupName):
        ctx.split_dim, ctx.cat_dim, ctx.group = split_dim, cat_dim, group
        return _all_to_all(x, split_dim, cat_dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _all_to_all(grad, ctx.cat_dim, ctx.split_dim, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, split_dim: int, cat_dim: int, group: GroupName) -> torch.Tensor:
    """Split `x` along split_dim into one piece per rank, exchange, and concatenate the
    received pieces along cat_dim: S(cat_dim) -> S(split_dim)."""
    size = dist.get_world_size(_resolve(group))
    pieces = torch.stack(x.chunk(size, split_dim))  # (size, ...)
    received = funcol.wait_tensor(funcol.all_to_all_single(pieces.contiguous(), None, None, group))
    return torch.cat(received.unbind(0), dim=cat_dim)


def copy_to_group(x: torch.Tensor, group: GroupName) -> torch.Tensor:
    return _CopyToGroup.apply(x, group)


def all_reduce(x: torch.Tensor, group: GroupName) -> torch.Tensor:
    return _AllReduce.apply(x, group)


def all_gather(x: torch.Tensor, dim: int, group: GroupName) -> torch.Tensor:
    return _AllGather.apply(x, dim, group)


def shard(x: torch.Tensor, dim: int, group: GroupName) -> torch.Tensor:
    return _Shard.apply(x, dim, group)


def reduce_scatter(x: torch.Tensor, dim: int, group: GroupName) -> torch.Tensor:
    return _ReduceScatter.apply(x, dim, group)


def gather_for_grad(x: torch.Tensor, dim: int, group: GroupName) -> torch.Tensor:
    return _GatherForGrad.apply(x, dim, group)


def all_to_all(x: torch.Tensor, split_dim: int, cat_dim: int, group: GroupName) -> torch.Tensor:
    return _AllToAll.apply(x, split_dim, cat_dim, group)


# The kind of collective each function performs in forward (CollectiveInfo.kind).
COLLECTIVES = {
    copy_to_group: "identity",
    all_reduce: "all_reduce",
    all_gather: "all_gather",
    shard: "slice",
    reduce_scatter: "reduce_scatter",
    gather_for_grad: "all_gather",
    all_to_all: "all_to_all",
}
