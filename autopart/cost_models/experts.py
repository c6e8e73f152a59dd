"""Expert parallelism's cost terms (`passes/expert_parallel.py` is what they price).

Per microbatch, every routed layer moves its rows over the ep ranks with an
all_to_all into its first grouped multiply and one out of its last, in forward and
again (their gradients) in backward, and in forward once more where its block is
recomputed. The next operator waits for each (none is overlapped). Rows captured in
fp32 travel in 16 bits under mixed precision. On an even routing a rank's experts
compute as many rows as its own tokens chose: its compute is that of its share of
the batch, as under data parallelism.

Once per step the gradients sync in two groups: the replicated weights over all
dp × ep ranks that split the batch, each expert's over its dp replicas.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopart.cost_models.comm import ALL_TO_ALL, CommModel
from autopart.cost_models.precision import is_mixed
from autopart.cost_models.summary import SegmentWork
from autopart.degrees import Axis

if TYPE_CHECKING:
    from autopart.cost_models.choices import Choices


def all_to_all_comm(own: list[SegmentWork], choices: Choices, comm: CommModel) -> float:
    """Seconds per microbatch of the all_to_alls of the routed layers in `own`."""
    return sum(segment_all_to_all(s, choices, comm, choices.recomputes(s)) for s in own)


def segment_all_to_all(
    seg: SegmentWork, choices: Choices, comm: CommModel, recomputed: bool
) -> float:
    """Seconds per microbatch of one segment's all_to_alls, `recomputed` or not."""
    exchanges = len(seg.segment.expert_rows)
    if choices.ep == 1 or not exchanges:
        return 0.0
    scale = 0.5 if is_mixed(choices.precision) else 1.0
    each = seg.expert_rows_bytes * scale / exchanges
    passes = 3 if recomputed else 2
    stride = choices.degrees.stride(Axis.EP)
    return passes * exchanges * comm.time(ALL_TO_ALL, each, choices.ep, stride)
