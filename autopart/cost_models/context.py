"""What context parallelism costs, as the rewrite runs it (`passes/context_parallel.py`).

Work. Each cp rank computes its 2 chunks of every sequence: 1/cp of the work of every
operator that acts on tokens alone. Ring attention attends the rank's seq/cp queries
over all seq keys, half of them skipped under causality as in one device's kernel:
1/cp of the whole attention's work too. So those operators are priced as the graph's
on 1/cp of the microbatch, which holds for a sequence captured static as for a dynamic
one. What the rewrite runs on the whole sequence (`cp_layout.py`: a mixture-of-experts
layer that flattens the tokens into rows, attention the ring does not take, what
follows either up to the next operator that takes the sequence's shards) is priced on
the whole microbatch, on every cp rank, and so is what it saves for backward
(`GraphSummary.context_parallel`).

Communication, per microbatch, over the cp axis (stride tp):
  ring attention (of the attentions that run as rings): the keys and values pass to
    the next rank cp−1 times in forward
    (and again in a recomputation), cp−1 times in backward with the key and value
    gradients travelling cp times beside them (in fp32). Each pass is issued before
    the rank computes its pairs for that step, so on NCCL it hides behind them while
    they last; on Gloo nothing hides;
  the ring's own operators: each pair of a query chunk and a key chunk runs as a dozen
    and more unfused operators (`ops/context_parallel.py`: the scores' product, the
    log-sum-exp, the probabilities, their product with the values and the merge into
    the running output; in backward the scores again and the three gradients' products
    accumulated), each paying its dispatch and passing over the pair's fp32 score
    block, where one device's fused kernel keeps the scores in its tiles. A rank
    computes 2cp + 1 pairs of an attention under causality (its two mirrored chunks'
    keys up to their own), 4cp without. Priced beside the attention's arithmetic,
    which stays that of the fused kernel on 1/cp of the work; exposed;
  the conversions to and from what runs whole: the sequence all-gathered before it
    in forward; where it meets the sequence's shards again each rank keeps its chunks
    (a slice), and the gradient is all-gathered in backward; a sum over the sequence
    all-reduced. Forward ones again in a recomputation; exposed, as tp's are;
  the parameters' gradients: under plain data parallelism the sync sums each rank's
    part over dp × cp once per step (`predict._dp_sync`, as for dp); otherwise every
    replicated weight applied to the local tokens is all-reduced over cp in backward,
    as it is produced (`copy_to_group`): exposed, every microbatch;
  the graph's outputs are gathered whole for the loss: one all-gather of the logits in
    forward, and the whole logits held on every rank (memory).
"""

from __future__ import annotations

from collections.abc import Sequence

from autopart.cost_models.comm import ALL_GATHER, ALL_REDUCE, CommModel
from autopart.cost_models.compute import ComputeModel
from autopart.cost_models.precision import bytes_scale, is_mixed
from autopart.cost_models.summary import SegmentWork
from autopart.cost_models.work import ATTENTION, NodeWork

GRADIENT_ACCUMULATION_BYTES = 4  # ring attention's key and value gradients travel in fp32
# Per pair of chunks in `ops/context_parallel.py` `_RingAttention`, (forward, backward):
# its operators, and its passes over the pair's fp32 score block (each operator that
# writes the block, or reads it: product, scale, log-sum-exp, exp, product with the
# values; in backward the probabilities again, their gradient and its two products).
RING_PAIR_OPERATORS = (16, 18)
RING_PAIR_SCORE_PASSES = (9, 18)
SCORE_BYTES = 4


def ring_comm(
    segments: Sequence[SegmentWork],
    cp: int,
    tp: int,
    precision: str,
    recomputed: Sequence[bool],
    comm: CommModel,
    compute: ComputeModel,
) -> float:
    """Seconds per microbatch the rings of `segments`' attentions leave exposed."""
    if cp == 1:
        return 0.0
    return sum(
        _ring_seconds(work, cp, tp, precision, again, comm, compute)
        for segment, again in zip(segments, recomputed)
        for work in segment.nodes
        if work.kind == ATTENTION and not work.cp_whole  # gathered, not a ring
    )


def ring_floor(
    local: Sequence[SegmentWork],
    whole: Sequence[SegmentWork],
    cp: int,
    tp: int,
    precision: str,
    recomputed: Sequence[bool],
    comm: CommModel,
    compute: ComputeModel,
) -> float:
    """A floor under what `local`'s attentions add to a step priced with every
    operator on 1/cp of the tokens (`local`, one rank's segments so evaluated), however
    the cp layout runs each: its ring's exposed seconds, or, run on the whole
    sequence, at least its compute on the whole microbatch (`whole`: the segments
    evaluated there) less that on the rank's share. Needs no cp layout."""
    if cp == 1:
        return 0.0

    def least(mine: SegmentWork, all_of: SegmentWork, again: bool) -> float:
        total = 0.0
        for work, full in zip(mine.nodes, all_of.nodes):
            if work.kind != ATTENTION:
                continue
            ring = _ring_seconds(work, cp, tp, precision, again, comm, compute)
            gathered = compute.time(full).total - compute.time(work).total
            total += max(0.0, min(ring, gathered))
        return total

    seconds: dict[tuple, float] = {}  # a block's copies share their operators' tuples
    for mine, all_of, again in zip(local, whole, recomputed):
        key = (id(mine.nodes), id(all_of.nodes), again)
        if key not in seconds:
            seconds[key] = least(mine, all_of, again)
    return sum(seconds[id(m.nodes), id(a.nodes), r] for m, a, r in zip(local, whole, recomputed))


def _ring_seconds(
    work: NodeWork,
    cp: int,
    tp: int,
    precision: str,
    again: bool,
    comm: CommModel,
    compute: ComputeModel,
) -> float:
    """Seconds per microbatch one attention's ring leaves exposed (`again`: its forward
    recomputed)."""
    kv = _key_value_bytes(work) * bytes_scale(work, precision)
    itemsize = 4 * bytes_scale(work, precision)
    grads = kv * GRADIENT_ACCUMULATION_BYTES / itemsize
    send = comm.exchange_time(kv, 0, tp, cp * tp)
    back = comm.exchange_time(kv + grads, 0, tp, cp * tp)
    cost = compute.time(work)
    hide = comm.overlaps_compute
    forward = (cp - 1) * max(0.0, send - (cost.forward / cp if hide else 0.0))
    backward = cp * max(0.0, back - (cost.backward / cp if hide else 0.0))
    pairs_forward, pairs_backward = ring_pairs_time(work, cp, compute)
    return (forward + pairs_forward) * (1 + again) + backward + pairs_backward


def ring_pairs_time(work: NodeWork, cp: int, compute: ComputeModel) -> tuple[float, float]:
    """(forward, backward) seconds per microbatch that one attention's ring adds to
    its fused arithmetic on a rank (module docstring): every pair's operators' dispatch
    and passes over its score block. `work` is the attention on 1/cp of the batch over
    the whole sequence, rows × keys scores: the same count as the rank's L/cp queries
    over every key, of which each of its pairs of chunks holds 1/(4cp)."""
    _, keys, head = work.shape or (1.0, 1.0, 1.0)
    rows = work.written_bytes / SCORE_BYTES / max(head, 1.0)  # batch × heads × queries
    pairs = 2 * cp + 1 if work.causal else 4 * cp
    scores = rows * keys * pairs / (4 * cp)
    bandwidth = compute.device.memory_bandwidth

    def seconds(operators: int, passes: int) -> float:
        dispatch = pairs * operators * compute.launch
        return (dispatch + passes * SCORE_BYTES * scores / bandwidth) * compute.scale

    (forward_ops, backward_ops), (forward_passes, backward_passes) = (
        RING_PAIR_OPERATORS,
        RING_PAIR_SCORE_PASSES,
    )
    return seconds(forward_ops, forward_passes), seconds(backward_ops, backward_passes)


def conversion_comm(
    segments: Sequence[SegmentWork],
    cp: int,
    tp: int,
    precision: str,
    recomputed: Sequence[bool],
    comm: CommModel,
) -> float:
    """Seconds per microbatch of the collectives of `segments`' conversions over cp
    (`SegmentWork.cp_traffic`): forward ones again where recomputed; activations
    captured in fp32 travel in 16 bits under mixed precision."""
    if cp == 1:
        return 0.0
    mixed = is_mixed(precision)
    return sum(
        comm.time(op, nbytes * (mixed_scale if mixed else 1.0), cp, tp)
        * count
        * (1 if backward else 1 + again)
        for segment, again in zip(segments, recomputed)
        for op, nbytes, backward, mixed_scale, count in segment.cp_traffic
    )


def _key_value_bytes(work: NodeWork) -> float:
    """The bytes of an attention's keys and values: each shaped as its output (batch,
    heads, head dim) but for the key length in place of the query length. Its reads
    would also count a mask, which ring attention does not pass."""
    queries, keys, _ = work.shape or (1.0, 1.0, 0.0)
    return 2 * work.written_bytes * keys / queries


def gradient_all_reduces(
    params: float, cp: int, tp: int, grad_bytes: float, comm: CommModel, tensors: float = 1.0
) -> float:
    """Seconds per microbatch of the all-reduces over cp of this rank's `params`
    parameters' gradients, in backward: one per parameter tensor of the `tensors` they
    are, each where its gradient is produced (`copy_to_group`), each its own collective
    with its own latency (1: their bytes as one buffer, a lower bound)."""
    if cp == 1 or not params:
        return 0.0
    tensors = max(1.0, tensors)
    return tensors * comm.time(ALL_REDUCE, params * grad_bytes / tensors, cp, tp)


def output_gather(output_bytes: float, cp: int, tp: int, comm: CommModel) -> float:
    """Seconds per microbatch of gathering the last segment's output (this rank's
    `output_bytes` of it) over cp."""
    if cp == 1 or not output_bytes:
        return 0.0
    return comm.time(ALL_GATHER, output_bytes * cp, cp, tp)
