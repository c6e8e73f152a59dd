"""Batch × batch products (CLIP's image × caption scores) under a split of the batch over
replicas: what the batch-products rewrite (`passes/batch_products.py`) and the runtime's
loss use. As the plan says (`Plan.batch_product_loss`):

- "rows": the loss is a mean over the product's rows, each row's term its own (a
  cross-entropy of each image over every caption). The rewrite gathers only the
  columns' side over the replicas with `collectives.gather_for_grad` (all-gather
  forward, reduce-scatter backward), so each replica scores its own rows against every
  column, and the loss runs on them with its own part of the target, as for any other
  output. Where no one operand gives the rows, both are gathered and each replica keeps
  its own rows of the whole (`own_rows`);
- "whole": the loss is not separable by rows (CLIP's symmetric loss also reads the
  columns). Both sides are gathered, and every replica hands the user's loss the whole
  product and the whole target (`WholeBatchLoss`), and the other batched outputs
  gathered too: each computes one device's loss.

Both are exact. Each replica's copy of the loss sends its gradient back through the
gathers, whose reduce-scatter sums the copies' gradients on each embedding's owner; the
data-parallel average over the replicas then gives one device's gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import fx
from torch.distributed import GroupName
from torch.utils import _pytree as pytree

from autopart.ops.collectives import all_gather
from autopart.ops.loss_match import example_outputs

ROWS, WHOLE = "rows", "whole"  # Plan.batch_product_loss


def own_rows(x: torch.Tensor, group: GroupName) -> torch.Tensor:
    """This replica's rows (dim 0) of `x`, gathered over `group`'s replicas in rank
    order; the other rows' gradient is zero."""
    pg = dist.distributed_c10d._resolve_process_group(group)
    size, rank = dist.get_world_size(pg), dist.get_rank(pg)
    rows = x.shape[0] // size
    return x.narrow(0, rank * rows, rows)


@dataclass(frozen=True)
class WholeBatchLoss:
    """The user's `loss_fn` on the whole batch's target: each replica's part of the
    target is gathered over `group` along dim 0, as the runtime split it."""

    loss_fn: Callable[[Any, Any], torch.Tensor]
    group: GroupName

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        def whole(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                return t
            return all_gather(t.detach(), 0, self.group)

        return self.loss_fn(output, pytree.tree_map(whole, target))


def loss_by_rows(loss_fn: Callable[[Any, Any], Any], gm: fx.GraphModule, batch: int) -> bool:
    """Whether `loss_fn` on the captured `gm`'s output is a mean over the rows of its batch
    × batch product, each row's term its own: on random outputs and a target of class
    indices (one per row), the loss of the whole equals the mean of two halves' losses.
    A loss that fails on a half, or differs, is not (it gets the whole)."""
    leaves = example_outputs(gm)
    if leaves is None or batch < 2 or batch % 2:
        return False
    (output,) = gm.graph.find_nodes(op="output")
    _, spec = pytree.tree_flatten(output.args[0])
    generator = torch.Generator().manual_seed(0)

    def real(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if x.is_floating_point():
            return torch.randn(x.shape, generator=generator, dtype=x.dtype)
        return torch.zeros(x.shape, dtype=x.dtype)

    values = [real(x) for x in leaves]
    target = torch.randint(0, batch, (batch,), generator=generator)

    def loss_of(rows: slice) -> torch.Tensor:
        part = [_rows_of(x, rows, batch) for x in values]
        model_output = gm.graph.process_outputs(pytree.tree_unflatten(part, spec))
        return loss_fn(model_output, target[rows])

    half = batch // 2
    try:
        with torch.no_grad():
            whole = loss_of(slice(0, batch))
            parts = (loss_of(slice(0, half)) + loss_of(slice(half, batch))) / 2
        return bool(torch.allclose(whole, parts, rtol=1e-5, atol=1e-6))
    except Exception:  # noqa: BLE001 - a loss that cannot run on a half reads the whole
        return False


def _rows_of(x: Any, rows: slice, batch: int) -> Any:
    if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch:
        return x[rows]
    return x
