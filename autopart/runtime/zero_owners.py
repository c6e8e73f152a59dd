"""ZeRO-1 and ZeRO-2 by whole parameters, for optimizers that are not elementwise.

An optimizer that reads a whole tensor at once (Adafactor's row and column statistics,
Shampoo's preconditioners, LAMB's trust ratio) would step differently on flat shards
(zero_replicas.py). Here each parameter keeps its shape and has one owner among the
data-parallel ranks, chosen largest first onto the least-loaded rank; a rank's
optimizer steps the parameters it owns, so it holds their state only (stage 1).

Gradients go to the owner: each parameter's gradient is summed onto its owner by a
reduce, launched while backward goes on once the parameter's last gradient of the
step has arrived (stage 1), or after every backward pass, freeing it at once on the
other ranks (stage 2); the owner averages. After the step every owner broadcasts its
updated parameters, so every rank again holds the same whole model.

Balance is by parameter count, not exact: a rank holds the state of at least 1/N of
the parameters and at most that plus the largest parameter.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from autopart.ops.params import lower


class OwnedParameters:
    """ZeRO stage 1 or 2 over whole `params` (given in backward order) on `group`; the
    summed gradients are divided by `divisor` (the group's size where None)."""

    def __init__(
        self,
        params: list[nn.Parameter],
        group: dist.ProcessGroup,
        accumulation: int,
        stage: int,
        divisor: int | None = None,
    ) -> None:
        if stage not in (1, 2):
            raise ValueError(f"OwnedParameters is ZeRO stage 1 or 2, not {stage}")
        self.params, self.group, self.accumulation, self.stage = params, group, accumulation, stage
        self.size = dist.get_world_size(group)
        self.divisor = divisor or self.size  # of the summed gradients: their mean by default
        global_rank = [dist.get_global_rank(group, r) for r in range(self.size)]
        self.owner = {id(p): global_rank[r] for p, r in owners(params, self.size)}
        me = global_rank[dist.get_rank(group)]
        self.mine = [p for p in params if self.owner[id(p)] == me]
        self._arrivals: dict[int, int] = {}
        self._pending: list[tuple[nn.Parameter, torch.Tensor, dist.Work]] = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    @property
    def shards(self) -> list[nn.Parameter]:
        """What this rank's optimizer steps: the parameters it owns, whole."""
        return self.mine

    def lower(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """Hold the parameters and gradients in `dtype` (16-bit copies of master
        weights kept elsewhere): the tensors lowered."""
        return lower(list(self.params), dtype)

    def begin(self) -> None:
        self._arrivals.clear()
        for p in self.params:
            p.grad = None

    def finish(self) -> None:
        """Reduce what backward did not reach, wait, and leave each owner its averaged
        gradients (summed over the backward passes of stage 2) and the others none."""
        for p in self.params:
            if p.grad is not None and self._arrivals.get(id(p), 0) < self.accumulation:
                self._reduce(p)  # a parameter some pass did not reach
        sums: dict[int, torch.Tensor] = {}
        mine = {id(p) for p in self.mine}
        for p, grad, work in self._pending:
            work.wait()
            if id(p) in mine:
                sums[id(p)] = grad if id(p) not in sums else sums[id(p)].add_(grad)
        self._pending.clear()
        for p in self.params:
            p.grad = sums[id(p)].div_(self.divisor) if id(p) in sums else None

    def after_step(self) -> None:
        broadcast_from_owners(self.params, self.owner, self.group)

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        assert isinstance(p, nn.Parameter)
        arrived = self._arrivals[id(p)] = self._arrivals.get(id(p), 0) + 1
        if self.stage == 2 or arrived == self.accumulation:
            self._reduce(p)

    def _reduce(self, p: nn.Parameter) -> None:
        grad = p.grad
        assert grad is not None
        p.grad = None  # stage 1 reduces once, after the last pass; stage 2 frees at once
        work = dist.reduce(grad, dst=self.owner[id(p)], group=self.group, async_op=True)
        assert work is not None
        self._pending.append((p, grad, work))


def broadcast_from_owners(
    params: Iterable[nn.Parameter], owner: dict[int, int], group: dist.ProcessGroup
) -> None:
    """Every rank of `group` again holds each of `params` as its owner (global rank, by
    id) stepped it."""
    works = [dist.broadcast(p.data, src=owner[id(p)], group=group, async_op=True) for p in params]
    for work in works:
        assert work is not None
        work.wait()


def owners(params: list[nn.Parameter], ranks: int) -> list[tuple[nn.Parameter, int]]:
    """(parameter, owning rank) for every parameter: largest first, each onto the rank
    holding the fewest elements so far (ties to the lowest rank): the same on every
    rank, as it depends on the shapes alone."""
    load = [0] * ranks
    out = []
    for p in sorted(params, key=lambda p: -p.numel()):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        load[rank] += p.numel()
        out.append((p, rank))
    return out
