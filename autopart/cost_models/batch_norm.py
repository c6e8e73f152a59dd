"""The cost of batch norms under a split of the batch over replicas
(`passes/batch_norm.py` is what it prices).

Where the batch is split over dp × ep, every batch norm in training mode all-reduces
its per-channel sums over those ranks once in forward (count, sums, sums of squares)
and once in backward (Σg and Σ(g·x̂)); with per-part statistics it takes the first
replica's running statistics instead, one broadcast in forward. Forward's collective
runs once more where its block is recomputed. Each is a few hundred bytes: their
latency is the cost, and the next operator waits for each.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopart.cost_models.comm import ALL_REDUCE, BROADCAST, CommModel
from autopart.cost_models.summary import SegmentWork
from autopart.degrees import Axis
from autopart.ops.batch_norm import backward_sum_bytes, first_replica_bytes, forward_sum_bytes

if TYPE_CHECKING:
    from autopart.cost_models.choices import Choices

FP32_BYTES = 4  # running statistics are kept in float32


def norm_sync_comm(own: list[SegmentWork], choices: Choices, comm: CommModel) -> float:
    """Seconds per microbatch of the all-reduces of the batch norms in `own`."""
    return sum(segment_norm_sync(s, choices, comm, choices.recomputes(s)) for s in own)


def segment_norm_sync(
    seg: SegmentWork, choices: Choices, comm: CommModel, recomputed: bool
) -> float:
    """Seconds per microbatch of one segment's batch-norm all-reduces, `recomputed` or
    not."""
    channels = seg.segment.norm_channels
    ranks = choices.degrees.batch_split
    if not channels or ranks == 1:
        return 0.0
    stride = choices.degrees.stride(Axis.EP if choices.ep > 1 else Axis.DP)
    if choices.per_part_statistics:
        forward = sum(
            comm.time(BROADCAST, first_replica_bytes(c, FP32_BYTES), ranks, stride)
            for c in channels
        )
        return forward * (2 if recomputed else 1)
    forward = sum(comm.time(ALL_REDUCE, forward_sum_bytes(c), ranks, stride) for c in channels)
    backward = sum(comm.time(ALL_REDUCE, backward_sum_bytes(c), ranks, stride) for c in channels)
    return forward * (2 if recomputed else 1) + backward
