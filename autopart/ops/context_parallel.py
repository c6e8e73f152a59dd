"""Context parallelism's operators: the sequence's mirrored layout, and ring attention.

Under context parallelism each of the cp ranks holds part of every sequence. Causal
attention does more work for late tokens than for early ones, so a rank holding one
contiguous quarter would idle while the last one works. The sequence is cut into 2·cp
chunks instead, and rank r holds chunks r and 2·cp−1−r (Llama 3's and Megatron's load
balancing): every rank then attends over the same number of (query, key) pairs.

    function       forward                            backward
    cp_shard       keep this rank's two chunks        gather the chunks, in order
    cp_gather      gather the chunks, in order        keep this rank's two chunks
    ring_attention attention of this rank's queries   the gradients of q, and of every
                   over every key: keys and values    rank's k and v, carried back round
                   pass round the ring of cp ranks    the ring to their owners

`cp_shard` and `cp_gather` are the tensor-parallel `shard` and `all_gather` for this
layout (the rewrite's conversions between whole and sequence-sharded values).

Ring attention never holds more than two ranks' keys and values. At each of cp steps a
rank attends its two query chunks over the two key chunks it holds (a pair whose keys
all come later is skipped; a pair on the diagonal is causal), merges the partial
results by their log-sum-exp, and passes the keys and values to the next rank while
it computes. Backward recomputes each pair's probabilities from the final log-sum-exp
(as flash attention's backward does), and the key and value gradients travel round
the ring with their keys until they reach their owner. Saved for backward: q, k, v,
the output and the log-sum-exp, as a fused kernel saves. The pairs are computed in
plain tensor operations, which run on every device and dtype; the output is laid out
as the captured attention's was (`ops.layout`: a fused kernel's [batch, seq, heads,
head_dim] order, which the graph's views after attention rely on).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.autograd import Function
from torch.distributed import GroupName

from autopart.ops.layout import DimOrder, empty_in_order


def _group(group: GroupName) -> tuple[dist.ProcessGroup, int, int]:
    pg = dist.distributed_c10d._resolve_process_group(group)
    return pg, dist.get_world_size(pg), dist.get_rank(pg)


def mirrored_chunks(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks of 2·cp that rank `rank` holds."""
    return rank, 2 * cp - 1 - rank


def _own_chunks(x: torch.Tensor, dim: int, group: GroupName) -> torch.Tensor:
    _, cp, rank = _group(group)
    if x.shape[dim] % (2 * cp):
        raise ValueError(
            f"context parallelism cuts the sequence into 2·cp = {2 * cp} chunks, but it "
            f"has {x.shape[dim]} tokens: use a length that is a multiple of {2 * cp}"
        )
    chunks = x.chunk(2 * cp, dim)
    first, second = mirrored_chunks(rank, cp)
    return torch.cat([chunks[first], chunks[second]], dim)


def _gather_chunks(x: torch.Tensor, dim: int, group: GroupName) -> torch.Tensor:
    _, cp, _ = _group(group)
    gathered = funcol.wait_tensor(funcol.all_gather_single(x.contiguous(), dim, group))
    pieces = gathered.chunk(2 * cp, dim)  # rank r's first and second chunks at 2r, 2r+1
    order: list[torch.Tensor] = list(pieces)
    for r in range(cp):
        first, second = mirrored_chunks(r, cp)
        order[first], order[second] = pieces[2 * r], pieces[2 * r + 1]
    return torch.cat(order, dim)


class _CpShard(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: GroupName) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _own_chunks(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _gather_chunks(grad, ctx.dim, ctx.group), None, None


class _CpGather(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: GroupName) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _gather_chunks(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _own_chunks(grad, ctx.dim, ctx.group), None, None


def cp_shard(x: torch.Tensor, dim: int, group: GroupName) -> torch.Tensor:
    return _CpShard.apply(x, dim, group)


def cp_gather(x: torch.Tensor, dim: int, group: GroupName) -> torch.Tensor:
    return _CpGather.apply(x, dim, group)


# -- ring attention -------------------------------------------------------------------

# A ring step in flight: its works, the buffers it sends and those it receives into.
_Pending = tuple[list[Any], list[torch.Tensor], list[torch.Tensor]]


class _Ring:
    """Passing tensors to the next rank of the group while receiving the previous one's."""

    def __init__(self, group: GroupName) -> None:
        self.pg, self.size, rank = _group(group)
        self.next = dist.get_global_rank(self.pg, (rank + 1) % self.size)
        self.prev = dist.get_global_rank(self.pg, (rank - 1) % self.size)

    def start(self, tensors: list[torch.Tensor]) -> _Pending:
        """Send `tensors` on and receive the previous rank's. The collectives take
        contiguous buffers: keys and values are often views (heads transposed out of
        [batch, seq, heads, head_dim]), so what is sent is made contiguous and what is
        received lands in fresh contiguous tensors of the same shapes, not `empty_like`'s
        copies of the views' strides."""
        sent = [t.contiguous() for t in tensors]
        received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.pg) for t in sent]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.pg) for r in received]
        return dist.batch_isend_irecv(ops), sent, received

    @staticmethod
    def finish(pending: _Pending) -> list[torch.Tensor]:
        works, _sent, received = pending  # the sent buffers live until their sends end
        for work in works:
            work.wait()
        return received


def _pairs(rank: int, source: int, cp: int, causal: bool):
    """(query half, key half, diagonal) for each pair of this rank's query chunks and
    `source`'s key chunks that attention computes: under causality, keys that all come
    after the queries are skipped."""
    for qi, q_chunk in enumerate(mirrored_chunks(rank, cp)):
        for ki, k_chunk in enumerate(mirrored_chunks(source, cp)):
            if causal and k_chunk > q_chunk:
                continue
            yield qi, ki, causal and k_chunk == q_chunk


def _acc(t: torch.Tensor) -> torch.Tensor:
    """`t` in the accumulation dtype: float32, or the input's where it is wider."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, diagonal: bool) -> torch.Tensor:
    s = torch.matmul(_acc(q), _acc(k).transpose(-2, -1)) * scale
    if diagonal:
        n = s.shape[-1]
        future = torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


class _RingAttention(Function):
    @staticmethod
    def forward(ctx: Any, q, k, v, group: GroupName, causal: bool, scale: float, order):
        ring = _Ring(group)
        cp, rank = ring.size, dist.get_rank(ring.pg)
        q_halves = q.chunk(2, -2)
        out = [_acc(h).new_zeros((*h.shape[:-1], v.shape[-1])) for h in q_halves]
        lse = [
            torch.full(h.shape[:-1], float("-inf"), dtype=out[0].dtype, device=q.device)
            for h in q_halves
        ]
        kv = [k, v]
        for step in range(cp):
            pending = ring.start(kv) if step < cp - 1 else None
            source = (rank - step) % cp
            k_halves, v_halves = kv[0].chunk(2, -2), kv[1].chunk(2, -2)
            for qi, ki, diagonal in _pairs(rank, source, cp, causal):
                s = _scores(q_halves[qi], k_halves[ki], scale, diagonal)
                block_lse = torch.logsumexp(s, -1)
                block_out = torch.matmul(torch.exp(s - block_lse.unsqueeze(-1)), _acc(v_halves[ki]))
                merged = torch.logaddexp(lse[qi], block_lse)
                out[qi] = out[qi] * torch.exp(lse[qi] - merged).unsqueeze(
                    -1
                ) + block_out * torch.exp(block_lse - merged).unsqueeze(-1)
                lse[qi] = merged
            if pending is not None:
                kv = _Ring.finish(pending)
        output = _laid_out(out, order, q)
        ctx.save_for_backward(q, k, v, output, torch.cat(lse, -1))
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        q, k, v, output, lse = ctx.saved_tensors
        ring = _Ring(ctx.group)
        cp, rank = ring.size, dist.get_rank(ring.pg)
        q_halves, lse_halves = q.chunk(2, -2), lse.chunk(2, -1)
        grad_halves = _acc(grad).chunk(2, -2)
        # D = rowsum(dO ∘ O): the softmax's Jacobian term of every pair of a query row.
        delta = (_acc(grad) * _acc(output)).sum(-1).chunk(2, -1)
        dq = [torch.zeros_like(_acc(h)) for h in q_halves]
        kv = [k, v]
        dkv = [torch.zeros_like(_acc(k)), torch.zeros_like(_acc(v))]
        for step in range(cp):
            source = (rank - step) % cp
            k_halves, v_halves = kv[0].chunk(2, -2), kv[1].chunk(2, -2)
            dk_halves, dv_halves = dkv[0].chunk(2, -2), dkv[1].chunk(2, -2)
            for qi, ki, diagonal in _pairs(rank, source, cp, ctx.causal):
                s = _scores(q_halves[qi], k_halves[ki], ctx.scale, diagonal)
                p = torch.exp(s - lse_halves[qi].unsqueeze(-1))
                dv_halves[ki].add_(torch.matmul(p.transpose(-2, -1), grad_halves[qi]))
                dp = torch.matmul(grad_halves[qi], _acc(v_halves[ki]).transpose(-2, -1))
                ds = p * (dp - delta[qi].unsqueeze(-1)) * ctx.scale
                dq[qi].add_(torch.matmul(ds, _acc(k_halves[ki])))
                dk_halves[ki].add_(torch.matmul(ds.transpose(-2, -1), _acc(q_halves[qi])))
            # The accumulated key and value gradients travel with their keys; after cp
            # passes they are back with their owner.
            moving = dkv + (kv if step < cp - 1 else [])
            received = _Ring.finish(ring.start(moving))
            dkv, kv = received[:2], received[2:] or kv
        dq_all = torch.cat(dq, -2).to(q.dtype)
        return dq_all, dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def _laid_out(halves: list[torch.Tensor], order: DimOrder | None, q: torch.Tensor) -> torch.Tensor:
    """The attention's output from its two halves (along the sequence), in q's dtype and
    in `order`, the dim order of the attention the ring replaces: the captured graph's
    views of it were traced against that layout (`ops.layout`)."""
    shape = (*halves[0].shape[:-2], 2 * halves[0].shape[-2], halves[0].shape[-1])
    output = empty_in_order(shape, order, q, q.dtype)
    for place, half in zip(output.chunk(2, -2), halves):
        place.copy_(half)
    return output


# scaled_dot_product_attention's arguments after q, k and v, in their positional order.
ATTENTION_ARGUMENTS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_ATTENTION_DEFAULTS = {
    "attn_mask": None,
    "dropout_p": 0.0,
    "is_causal": False,
    "scale": None,
    "enable_gqa": False,
}


def attention_arguments(
    positional: Sequence[Any], keywords: Mapping[str, Any]
) -> dict[str, Any] | None:
    """`scaled_dot_product_attention`'s arguments after q, k and v by name, defaults
    filled in, from those given positionally after v (torch.export writes `is_causal=True`
    as the positional (None, 0.0, True)) and by keyword; None where they do not bind."""
    if len(positional) > len(ATTENTION_ARGUMENTS):
        return None
    named = dict(zip(ATTENTION_ARGUMENTS, positional))
    if any(key in named or key not in _ATTENTION_DEFAULTS for key in keywords):
        return None
    return {**_ATTENTION_DEFAULTS, **named, **keywords}


def _number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def ring_refusal(named: dict[str, Any] | None) -> str:
    """Why ring attention cannot compute an attention of these arguments
    (`attention_arguments`), or "" where it can: it takes no mask and no dropout, and a
    causal flag, scale and grouped-query flag known when the graph is rewritten."""
    if named is None:
        return "arguments that do not bind to scaled_dot_product_attention's"
    if named["attn_mask"] is not None:
        return "a mask"
    if not _number(named["dropout_p"]) or named["dropout_p"] != 0.0:
        return "dropout"
    if not isinstance(named["is_causal"], bool) or not isinstance(named["enable_gqa"], bool):
        return "a causal or grouped-query flag that is not a constant"
    if named["scale"] is not None and not _number(named["scale"]):
        return "a scale that is not a constant"
    return ""


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *args: Any,
    dim_order: DimOrder | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """`scaled_dot_product_attention(q, k, v, ...)` of [batch, heads, seq, head_dim]
    tensors sharded over the sequence in the mirrored layout of the cp group, causal or
    not, with its scale and grouped-query flag. Called as the rewrite leaves the
    attention's node: its own arguments after v, positional (`attention_arguments`) and
    keyword, with the cp group appended as the last positional one, and the dim order
    of the captured attention's output (`ops.layout`), which the output keeps. Masks
    and dropout are not taken (`ring_refusal`: the rewrite gathers the sequence for
    such attention)."""
    *positional, group = args
    named = attention_arguments(positional, kwargs)
    refusal = ring_refusal(named)
    if refusal or named is None:
        raise ValueError(f"ring attention cannot compute attention with {refusal}")
    if named["enable_gqa"] and k.shape[-3] != q.shape[-3]:
        repeats = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(repeats, -3), v.repeat_interleave(repeats, -3)
    scale = named["scale"]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _RingAttention.apply(q, k, v, group, named["is_causal"], scale, dim_order)
