"""Cross-entropy over logits sharded along the vocabulary, without gathering them.

Each rank of the tp group holds `logits[..., rank·V/tp : (rank+1)·V/tp]`. The loss needs
three reductions over the vocabulary, each an all-reduce of one value per token rather
than a gather of V/tp values per token:

    m      = max over the vocabulary          (all-reduce MAX; a constant for autograd)
    s      = Σ exp(logits - m)                (all-reduce SUM)
    x_t    = the target's logit - m           (the rank holding the target picks it,
                                               the others give 0; all-reduce SUM)
    loss_i = log(s) - x_t                      = log Σ exp(logits) - logits[target]

and the mean over the tokens whose target is not `ignore_index`, as
`F.cross_entropy(reduction="mean")` takes it. Every rank ends with the same loss. The
gradient of each rank's slice, (softmax - onehot(target)) / count, is local: backward
communicates nothing (the head's input gradient is summed by the rewrite's own
collective, as for any column-parallel product).

The arithmetic is in fp32 whatever the logits' dtype, as autocast runs cross-entropy.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Function


class _VocabParallelCrossEntropy(Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        group: dist.ProcessGroup,
        ignore_index: int,
    ) -> torch.Tensor:
        x = logits.float()
        width = x.shape[-1]
        first = dist.get_rank(group) * width
        top = x.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        exp = (x - top.unsqueeze(-1)).exp_()
        total = exp.sum(dim=-1)
        dist.all_reduce(total, group=group)
        valid = target != ignore_index
        local = target - first
        here = valid & (local >= 0) & (local < width)
        index = local.clamp(0, width - 1).unsqueeze(-1)
        picked = (x.gather(-1, index).squeeze(-1) - top).masked_fill(~here, 0.0)
        dist.all_reduce(picked, group=group)
        # Ignored tokens are zeroed, not multiplied by 0: their terms may be inf or nan.
        per_token = (total.log() - picked).masked_fill(~valid, 0.0)
        count = valid.sum()
        exp.div_(total.unsqueeze(-1))  # the softmax of this rank's slice, for backward
        ctx.save_for_backward(exp, index, here, valid, count)
        ctx.dtype = logits.dtype
        return per_token.sum() / count

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        softmax, index, here, valid, count = ctx.saved_tensors
        g = softmax.scatter_add(-1, index, -here.unsqueeze(-1).to(softmax.dtype))
        g.mul_((valid.to(g.dtype) * (grad / count)).unsqueeze(-1))
        return g.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: dist.ProcessGroup,
    ignore_index: int = -100,
) -> torch.Tensor:
    """`F.cross_entropy(full_logits.flatten(0, -2), target.flatten(), ignore_index=...)`
    (mean reduction) from this rank's vocabulary slice `logits` [..., V/tp] and the whole
    `target` [...], the same on every rank of `group`. Slices are in rank order, as
    `ops.shards.local_shard` cuts them."""
    if target.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets of shape {tuple(target.shape)} for logits of shape {tuple(logits.shape)}"
        )
    flat_logits = logits.reshape(-1, logits.shape[-1])
    return _VocabParallelCrossEntropy.apply(flat_logits, target.reshape(-1), group, ignore_index)
