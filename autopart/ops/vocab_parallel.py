"""Local operators that replace an operator whose table is sharded over the vocabulary.

`vocab_parallel_embedding` looks up only the rows this rank holds: ids outside its
range give zeros, so the ranks' outputs are partial sums of the whole lookup (one
all-reduce, inserted by the rewrite, completes it) and each rank's table receives the
gradient of its own rows only. Plain autograd differentiates it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import GroupName

from autopart.ops.layout import DimOrder, in_dim_order


def vocab_parallel_embedding(
    weight: torch.Tensor,
    ids: torch.Tensor,
    group: GroupName,
    padding_idx: int = -1,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
    *,
    dim_order: DimOrder | None = None,
) -> torch.Tensor:
    """This rank's share of `embedding(full_weight, ids)`, rows [rank·V/tp, (rank+1)·V/tp),
    in the captured lookup's `dim_order` (`ops.layout`). `embedding`'s other arguments
    are taken at their defaults only (the rule checks)."""
    assert (padding_idx, scale_grad_by_freq, sparse) == (-1, False, False)
    pg = dist.distributed_c10d._resolve_process_group(group)
    rows = weight.shape[0]
    first = dist.get_rank(pg) * rows
    local = ids - first
    outside = (local < 0) | (local >= rows)
    out = torch.nn.functional.embedding(local.masked_fill(outside, 0), weight)
    return in_dim_order(out.masked_fill(outside.unsqueeze(-1), 0.0), dim_order)
