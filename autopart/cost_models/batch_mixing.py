"""The cost of taking a model's mixing of its batch over the whole batch where the batch
is split over replicas (dp × ep): `passes/batch_products.py` and
`passes/batch_statistics.py` are what it prices (the batch norms' is `batch_norm.py`).

Per microbatch, each operand of a batch × batch product the rewrite gathers is
all-gathered over those ranks in forward (again where its block is recomputed) and its
gradient reduce-scattered in backward: both sides where the loss gets the whole
product, only the columns' side where it is a mean over the product's rows (the rows'
side stays each replica's own). Each statistic combined over the batch is all-reduced
once in forward and once in backward, a few numbers whose latency is the cost. With
per-part statistics the statistics stay each part's own. The next operator waits for
each. The product itself then runs on every replica over the whole batch's columns
(and, for the whole, its rows): its flops are those of a few score rows, left out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopart.cost_models.comm import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, CommModel
from autopart.cost_models.precision import is_mixed
from autopart.cost_models.summary import SegmentWork
from autopart.degrees import Axis
from autopart.ops.batch_products import ROWS

if TYPE_CHECKING:
    from autopart.cost_models.choices import Choices


def mixing_sync_comm(own: list[SegmentWork], choices: Choices, comm: CommModel) -> float:
    """Seconds per microbatch of the gathers and all-reduces of the segments in `own`."""
    return sum(segment_mixing_sync(s, choices, comm, choices.recomputes(s)) for s in own)


def segment_mixing_sync(
    seg: SegmentWork, choices: Choices, comm: CommModel, recomputed: bool
) -> float:
    """Seconds per microbatch of one segment's gathers and all-reduces, `recomputed` or
    not."""
    ranks = choices.degrees.batch_split
    statistics = () if choices.per_part_statistics else seg.segment.statistics
    if ranks == 1 or not (seg.gathered_bytes or statistics):
        return 0.0
    stride = choices.degrees.stride(Axis.EP if choices.ep > 1 else Axis.DP)
    forward, backward = 0.0, 0.0
    gathered = seg.gathered_bytes
    if choices.batch_product_loss == ROWS:
        gathered -= seg.rows_bytes
    if gathered:
        whole = gathered * ranks * (0.5 if is_mixed(choices.precision) else 1.0)
        forward += comm.time(ALL_GATHER, whole, ranks, stride)
        backward += comm.time(REDUCE_SCATTER, whole, ranks, stride)
    summed = sum(comm.time(ALL_REDUCE, float(b), ranks, stride) for b in statistics)
    return (forward + summed) * (2 if recomputed else 1) + backward + summed
