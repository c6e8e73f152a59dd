"""Cutting a whole tensor into this rank's slice along a dim, and putting it back together.

A fused weight (q/k/v in one matrix) is cut part by part, so each rank holds its slice
of every part.
"""

from __future__ import annotations

import torch


def local_shard(full: torch.Tensor, dim: int, tp: int, rank: int, parts: int = 1) -> torch.Tensor:
    """This rank's slice of `full` along `dim`; with `parts` > 1 (a fused weight such as
    q/k/v), this rank's slice of each part, concatenated."""
    dim = dim + full.dim() if dim < 0 else dim
    pieces = [part.chunk(tp, dim)[rank] for part in full.chunk(parts, dim)]
    return torch.cat(pieces, dim) if parts > 1 else pieces[0]


def unshard(gathered: list[torch.Tensor], dim: int, parts: int = 1) -> torch.Tensor:
    """The inverse of `local_shard`, from every rank's slice in rank order."""
    if parts == 1:
        return torch.cat(gathered, dim)
    per_rank = [g.chunk(parts, dim) for g in gathered]
    return torch.cat([torch.cat([r[k] for r in per_rank], dim) for k in range(parts)], dim)
