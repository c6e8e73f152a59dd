"""The loss of one program's output: the user's function, or the vocabulary-parallel
cross-entropy where the program returns its logits sharded over the vocabulary.

A program returns sharded logits only where `parallelize` recognized the user's loss as
a standard cross-entropy (ops/loss_match.py), so the parallel loss is that loss. It was
recognized for a target of class indices shaped as the logits without their last dim;
a step whose target is not such gathers the logits and calls the user's function, which
is exact whatever it computes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from autopart.batch import split_batch
from autopart.ops import collectives as c
from autopart.ops.loss_match import CrossEntropy
from autopart.ops.program import RankProgram
from autopart.ops.vocab_parallel_loss import vocab_parallel_cross_entropy

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True)
class StepLoss:
    """`loss_fn(output, target)` for the outputs of a program whose `sharded` loss's
    logits leaf is this rank's vocabulary slice over `group` (None: outputs are whole).
    `recognized`: the loss as recognized (a standard cross-entropy), whatever the
    layout."""

    loss_fn: LossFn
    group: dist.ProcessGroup | None = None
    sharded: CrossEntropy | None = None

    def part(self, output: Any, target: Any, share: float) -> torch.Tensor:
        """One microbatch's term of the step's loss: its loss times its `share`."""
        if share == 0.0:
            # Every token of the part is ignored: it adds nothing to the step's mean (its
            # own mean would be 0/0), but its backward still runs, as on every rank.
            floats = [t for t in pytree.tree_leaves(output) if _is_float(t)]
            return sum((t.sum() for t in floats), torch.zeros(())) * 0.0
        return self(output, target) * share

    def for_program(self, program: RankProgram) -> StepLoss:
        return replace(self, sharded=program.vocab_parallel_loss)

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        if self.sharded is None:
            return self.loss_fn(output, target)
        assert self.group is not None, "sharded logits come with their tp group"
        logits = pytree.tree_leaves(output)[self.sharded.logits]
        if isinstance(target, torch.Tensor) and _indices_for(target, logits):
            return vocab_parallel_cross_entropy(
                logits, target, self.group, self.sharded.ignore_index
            )
        return self.loss_fn(whole_output(output, self.sharded, self.group), target)


def microbatch_shares(
    loss: CrossEntropy | None, target: Any, dp: int, dp_rank: int, microbatches: int
) -> list[float]:
    """The weight of each of this rank's microbatches in the step's loss, given the
    global `target` and the `loss` as recognized (None: another loss). The gradient
    sync averages over the dp replicas, so weights of 1/m give the mean over the batch
    when every part counts alike. A cross-entropy that ignores some tokens is the mean
    over the others: there a part's weight is its share of the counted tokens, times
    dp, so that the step's loss and gradient are one device's however the ignored
    tokens fall."""
    counts = counted_tokens(loss, target, dp, microbatches)
    return shares_of(counts, dp_rank, microbatches)


def counted_tokens(
    loss: CrossEntropy | None, target: Any, parts: int, microbatches: int
) -> list[list[int]] | None:
    """The tokens `loss` counts in each microbatch of each of `parts` slices of
    `target`; None where every part counts alike (another loss, a target of values)."""
    if loss is None or not isinstance(target, torch.Tensor) or target.is_floating_point():
        return None
    counted = target != loss.ignore_index
    m = microbatches
    slices = [split_batch(counted, r, parts) for r in range(parts)]
    return [[int(split_batch(s, i, m, "microbatches").sum()) for i in range(m)] for s in slices]


def shares_of(counts: list[list[int]] | None, dp_rank: int, microbatches: int) -> list[float]:
    """The weights of rank `dp_rank`'s microbatches, given every rank's counted tokens
    (`counted_tokens`, one row a rank)."""
    even = [1.0 / microbatches] * microbatches
    if counts is None:
        return even
    total = sum(map(sum, counts))
    if total == 0 or len({c for row in counts for c in row}) == 1:
        return even  # no counted token at all is 0/0 on one device too
    return [c * len(counts) / total for c in counts[dp_rank]]


def whole_output(output: Any, sharded: CrossEntropy | None, group: dist.ProcessGroup | None) -> Any:
    """`output` with the logits of the `sharded` loss (this rank's slices over `group`)
    gathered, differentiably, as one device computes them; as it is where none are."""
    if sharded is None:
        return output
    assert group is not None, "sharded logits come with their tp group"
    leaves, spec = pytree.tree_flatten(output)
    i = sharded.logits
    leaves[i] = c.all_gather(leaves[i], leaves[i].dim() - 1, group.group_name)
    return pytree.tree_unflatten(leaves, spec)


def _is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def _indices_for(target: torch.Tensor, logits: torch.Tensor) -> bool:
    """Class indices, one per row of the logits."""
    return not target.is_floating_point() and target.shape == logits.shape[:-1]
