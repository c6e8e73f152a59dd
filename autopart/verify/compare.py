"""Setting a plan's per-rank values beside one device's, node by node.

A rank's value of a node is a slice of the single-device value: its data-parallel rank's
share of the batch, cut into microbatches, and its tensor-parallel piece (a shard along
a dim, a partial sum, or the whole, as the node's `TP_PLACE` says). `reassemble` undoes
both: it joins the tensor-parallel pieces of each (replica, microbatch), then lays those
along the batch dim (the one dim whose size they divide). A fused weight's output
(q/k/v in one product) is sharded part by part, which the node's placement does not
say: a sharded node is joined both ways and the closer one kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from autopart.ops.shards import unshard

FUSED_PARTS = (1, 2, 3)  # a fused product's parts: q/k/v, gate/up


@dataclass(frozen=True, slots=True)
class RankValue:
    """One rank's value of a node for one microbatch."""

    dp: int
    tp: int
    microbatch: int
    placement: Placement
    value: torch.Tensor


def relative_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest elementwise difference, relative to the largest magnitude of `want`."""
    if got.shape != want.shape:
        return float("inf")
    scale = want.double().abs().max().item() if want.numel() else 0.0
    gap = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
    return gap / max(scale, 1e-12)


def node_difference(
    want: torch.Tensor, values: Sequence[RankValue], dp: int, tp: int, microbatches: int
) -> float | None:
    """How far the ranks' `values` of a node are from its single-device value `want`;
    None where they cannot be reassembled (a node some rank did not run)."""
    if not values:
        return None
    candidates = []
    for parts in FUSED_PARTS:
        rows = []
        for d in range(dp):
            for k in range(microbatches):
                pieces = sorted(
                    (v for v in values if v.dp == d and v.microbatch == k), key=lambda v: v.tp
                )
                if [v.tp for v in pieces] != list(range(tp)):
                    return None
                joined = _join_tensor_parallel(pieces, parts)
                if joined is None:
                    break
                rows.append(joined)
        whole = _join_batch(rows, want) if len(rows) == dp * microbatches else None
        if whole is not None:
            candidates.append(relative_difference(whole, want))
        if not isinstance(values[0].placement, Shard):
            break  # only a shard's join depends on the parts
    return min(candidates) if candidates else None


def _join_tensor_parallel(pieces: Sequence[RankValue], parts: int) -> torch.Tensor | None:
    placement = pieces[0].placement
    tensors = [p.value for p in pieces]
    if isinstance(placement, Replicate) or len(tensors) == 1:
        return tensors[0]
    if isinstance(placement, Partial):
        return torch.stack(tensors).sum(0)
    if isinstance(placement, Shard):
        dim = placement.dim
        if tensors[0].dim() <= dim or tensors[0].shape[dim] % parts:
            return None
        return unshard(tensors, dim, parts)
    return None


def _join_batch(rows: list[torch.Tensor], want: torch.Tensor) -> torch.Tensor | None:
    """The rows (replica-major, then microbatch) laid along the dim they split."""
    if len(rows) == 1:
        return rows[0]
    if all(r.shape == want.shape for r in rows):
        # Not batched, every replica computes the whole, and they agree; or an
        # operator that reduces over the batch (a batch mean), whose parts are not it.
        return rows[0] if all(torch.equal(r, rows[0]) for r in rows) else None
    first = rows[0].shape
    split = [
        d
        for d in range(min(len(first), want.dim()))
        if first[d] != want.shape[d] and first[d] * len(rows) == want.shape[d]
    ]
    if len(split) != 1:
        return None
    return torch.cat(rows, split[0])
