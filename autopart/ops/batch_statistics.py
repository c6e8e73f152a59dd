"""Statistics over the batch taken over the whole batch where it is split over replicas:
what the batch-statistics rewrite (`passes/batch_statistics.py`) puts after a reduction
over the batch that the model combines nonlinearly, such as a mixture-of-experts
load-balancing loss's token counts and router probabilities.

Each replica holds an equal part of the batch. `replica_mean` replaces its part's
statistic by the mean of every replica's: a mean over the batch becomes the whole
batch's mean, and a sum becomes the whole batch's sum over the replicas' count, which
the model's own division by its part's token count turns into the whole batch's
fraction (the rewrite takes a sum only where the model divides it so).

Every replica then computes the same loss term, and the runtime averages the replicas'
losses and gradients. The adjoint of a mean over replicas is the same mean: the
gradient each replica's copy of the loss sends back is averaged over the replicas, so
each replica's part receives its share of the one loss, as on one device.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.autograd import Function
from torch.distributed import GroupName


def replica_mean(x: torch.Tensor, group: GroupName) -> torch.Tensor:
    """The mean of `x` over `group`'s replicas; its gradient is averaged alike."""
    return _ReplicaMean.apply(x, group)


def _mean_over(x: torch.Tensor, group: GroupName) -> torch.Tensor:
    size = dist.get_world_size(dist.distributed_c10d._resolve_process_group(group))
    total = funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", group))
    return total / size


class _ReplicaMean(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: GroupName) -> torch.Tensor:
        ctx.group = group
        return _mean_over(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _mean_over(grad, ctx.group), None
