"""What every rank must learn at the end of a step, in one all-reduce.

After backward, and before the optimizer step, the ranks sum one small vector:

    loss        each batch share's loss, from the rank that reports it: the global loss
    square sum  each rank's share of the squared gradient norm (grad_norm.py): the
                global norm, for clipping, for `pm.grad_norm`, and to find a non-finite
                gradient
    hashes      two checksums of each rank's inputs, summed with their squares over the
                ranks that must have passed the same inputs: they agree if and only if
                n·Σh² = (Σh)², exactly, in float64

Every rank then holds the same numbers and takes the same decision (step, skip, raise),
before anything reaches the weights. Under the global convention every rank must have
passed the same inputs; under the per-rank one, the ranks of one batch share (the tp,
cp and pp ranks of one data-parallel rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

# Two checksums modulo primes below 2^12: their squares summed over 2^14 ranks stay
# integers that float64 holds exactly; two of them miss a difference about once in 2^24.
_MODULI = (4093, 4091)
_WEIGHTS = (251, 241)  # the position weights' periods, coprime with the moduli


def input_hashes(tree: object, device: torch.device) -> torch.Tensor:
    """Two checksums of every tensor in `tree` (values and order), as float64 on
    `device`, computed where the tensors are: no host synchronization."""
    sums = [torch.zeros((), dtype=torch.int64, device=device) for _ in _MODULI]
    for i, leaf in enumerate(t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)):
        data = leaf.detach().contiguous().reshape(-1).view(torch.uint8).to(torch.int64)
        position = torch.arange(data.numel(), device=data.device)
        for k, period in enumerate(_WEIGHTS):
            term = (data * (position % period + 1)).sum() * (i + 1)
            sums[k] = sums[k] + term.to(device)
    return torch.stack([s % m for s, m in zip(sums, _MODULI)]).double()


@dataclass(frozen=True, slots=True)
class StepSums:
    loss: float
    square_sum: float
    agree: bool  # the ranks that must have passed the same inputs did
    shares_alike: bool  # every batch share passed the same inputs (more than one share)


def sum_step(
    loss: torch.Tensor,
    square_sum: torch.Tensor,
    hashes: torch.Tensor,
    share: int,
    shares: int,
    group: dist.ProcessGroup | None,
) -> StepSums:
    """The step's sums over `group` (None: a world of one). `loss` is this rank's
    contribution to the global loss, `square_sum` to the squared norm; `hashes`
    (input_hashes) are checked among the ranks of batch share `share` of `shares`."""
    device = hashes.device
    slots = torch.zeros(shares, 2 * len(_MODULI), dtype=torch.float64, device=device)
    slots[share] = torch.cat([hashes, hashes.square()])
    count = torch.zeros(shares, dtype=torch.float64, device=device)
    count[share] = 1.0
    head = torch.stack([loss.to(device, torch.float64), square_sum.to(device, torch.float64)])
    vector = torch.cat([head, slots.reshape(-1), count])
    if group is not None:
        dist.all_reduce(vector, group=group)
    values = vector.tolist()
    sums = torch.tensor(values[2 : 2 + slots.numel()], dtype=torch.float64).view(shares, -1)
    n = torch.tensor(values[2 + slots.numel() :], dtype=torch.float64)
    h, h2 = sums[:, : len(_MODULI)], sums[:, len(_MODULI) :]
    agree = bool((n[:, None] * h2 == h.square()).all())
    means = h / n[:, None]
    alike = shares > 1 and bool((means == means[0]).all())
    return StepSums(values[0], values[1], agree, alike)


def is_finite(*values: float) -> bool:
    return all(math.isfinite(v) for v in values)
