"""What the data-parallel states share: the optimizer factory, what the plan decides
about the dp axis, and the parameter sets that sync over other groups. A leaf of the
runtime: data_parallel.py imports zero.py, which imports offload.py, and all three read
these types from here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from autopart.plan import Plan
from autopart.policy import (
    LOW_DTYPES,
    PARAM_DTYPES,
    REDUCE_DTYPES,
    MasterWeights,
    OuterOptimizer,
    outer_optimizer,
)

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True, slots=True)
class SyncSettings:
    """The dp axis as the plan sets it: how gradients are synchronized and where the
    optimizer steps."""

    zero: int  # ZeRO stage, 0-3
    accumulation: int  # backward passes (microbatches) that contribute to each step
    sync_every: int | None = None  # local SGD: average the replicas every this many steps
    sync_warmup: int = 0  # local SGD: steps of plain data parallelism first
    compression: str | None = None  # stage 0's gradient all-reduce, compressed
    outer: OuterOptimizer | None = None  # local SGD's outer step (DiLoCo)
    offload: bool = False  # the optimizer state on the host
    # With offload: the fp32 master weights on the host too, the device holding copies
    # in this 16-bit dtype.
    masters_dtype: torch.dtype | None = None
    # 16-bit parameters (precision "bf16-params"): the model holds its parameters in this
    # dtype, the optimizer steps fp32 masters of them (ZeRO's shards, or one replica's
    # whole), and the gradients are reduced in `reduce_dtype`.
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype = torch.float32

    @classmethod
    def of(cls, plan: Plan) -> SyncSettings:
        host = plan.master_weights == MasterWeights.HOST
        return cls(
            zero=plan.zero,
            accumulation=plan.microbatches,
            sync_every=plan.sync_every,
            sync_warmup=plan.sync_warmup,
            compression=plan.grad_compression,
            outer=outer_optimizer(plan.outer_optimizer) if plan.outer_optimizer else None,
            offload=plan.offload,
            masters_dtype=LOW_DTYPES.get(plan.precision) if host else None,
            param_dtype=PARAM_DTYPES.get(plan.precision),
            reduce_dtype=REDUCE_DTYPES[plan.reduce_dtype],
        )


@dataclass(frozen=True)
class ContextSums:
    """Parameters whose gradient each context-parallel rank holds a part of (`fqns`,
    `RankProgram.cp_summed`), summed over `group` (dp × cp) and divided by the dp
    replicas: the whole gradient's mean over the replicas."""

    group: dist.ProcessGroup
    fqns: frozenset[str]


@dataclass(frozen=True)
class ExpertShards:
    """Stacked expert weights split over ep (`fqns`, `RankProgram.ep_sharded`): each
    rank's gradient already sums every ep rank's tokens, so it is summed over `group`
    (the dp replicas of the same experts) and divided by `shares`, the batch's shares
    (dp × ep), as the other weights' are averaged over them. `replica` is the ep group:
    the ranks of one replica of the model, each with its share of the replica's batch."""

    group: dist.ProcessGroup
    fqns: frozenset[str]
    shares: int
    replica: dist.ProcessGroup
