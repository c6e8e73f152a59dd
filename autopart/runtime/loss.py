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

from autopart.ops import collectives as c
from autopart.ops.loss_match import CrossEntropy
from autopart.ops.program import RankProgram
from autopart.ops.vocab_parallel_loss import vocab_parallel_cross_entropy

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True)
class StepLoss:
    """`loss_fn(output, target)` for the outputs of a program whose `sharded` loss's
    logits leaf is this rank's vocabulary slice over `group` (None: outputs are whole)."""

    loss_fn: LossFn
    group: dist.ProcessGroup | None = None
    sharded: CrossEntropy | None = None

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


def _indices_for(target: torch.Tensor, logits: torch.Tensor) -> bool:
    """Class indices, one per row of the logits."""
    return not target.is_floating_point() and target.shape == logits.shape[:-1]
