"""The global gradient norm of a ParallelModule, each gradient element counted once.

The optimizer of each rank steps its own tensors: whole parameters, tensor-parallel
slices, ZeRO's flat shards, host copies under offload. Some of them hold the same
elements of the model's parameters as another rank's (a norm's weight on every tp rank,
a parameter on every dp replica at ZeRO-0, an expert-free weight on every ep rank); the
norm must count those once, as one device counts each parameter once. `Holdings` names
every stepped tensor as pieces (boxes) of whole parameters; the ranks exchange the boxes
they hold once, and each box is counted on the lowest rank that holds it. Each step
then costs one pass over the gradients and no collective of its own: the caller sums
this rank's square sum over the world together with the loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from autopart.degrees import MESH_AXES
from autopart.runtime.holdings import Held, Holdings

if TYPE_CHECKING:
    from autopart.runtime.parallel_module import ParallelModule

BoxKey = tuple[str, tuple[int, ...], tuple[int, ...]]  # whole tensor, offsets, sizes


@dataclass(frozen=True, slots=True)
class _Counted:
    """One stepped tensor, and which of its pieces this rank counts (None: all)."""

    tensor: torch.Tensor
    held: Held
    pieces: tuple[int, ...] | None


class GradientNorm:
    """The square sum of this rank's share of the global gradient norm, and clipping."""

    def __init__(self, pm: ParallelModule) -> None:
        optimizer = pm.optimizer
        stepped = [t for g in optimizer.param_groups for t in g["params"]] if optimizer else []
        holdings = Holdings(pm)
        held = [holdings.of(t) for t in stepped]
        keys = [[_key(p) for p in h.pieces(t.detach())] for t, h in zip(stepped, held)]
        owner = _owners(keys, pm.groups.group(*MESH_AXES))
        me = dist.get_rank() if dist.is_initialized() else 0
        self.stepped = stepped
        self.counted: list[_Counted] = []
        seen: set[BoxKey] = set()  # a rank may hold one box twice (tied weights)
        for tensor, h, boxes in zip(stepped, held, keys):
            mine = [i for i, k in enumerate(boxes) if owner[k] == me and k not in seen]
            seen.update(boxes[i] for i in mine)
            if len(mine) == len(boxes):
                self.counted.append(_Counted(tensor, h, None))
            elif mine:
                self.counted.append(_Counted(tensor, h, tuple(mine)))

    def square_sum(self) -> torch.Tensor:
        """This rank's share of the squared global norm (fp32, 0-d): summed over the
        world it is the squared norm of the whole model's gradient."""
        whole, parts = [], []
        for c in self.counted:
            grad = c.tensor.grad
            if grad is None:
                continue
            if c.pieces is None:
                whole.append(grad)
            else:
                pieces = c.held.pieces(grad)
                parts += [pieces[i].view for i in c.pieces]
        norms = [n.float() for n in torch._foreach_norm(whole)] if whole else []
        norms += [p.float().norm() for p in parts]
        if not norms:
            return torch.zeros((), dtype=torch.float32, device=self._device())
        return torch.stack(norms).square().sum()

    @torch.no_grad()
    def clip_(self, norm: float, max_norm: float) -> None:
        """Scale every stepped gradient as torch.nn.utils.clip_grad_norm_ does for a
        total norm of `norm`."""
        coefficient = min(max_norm / (norm + 1e-6), 1.0)
        grads = [t.grad for t in self.stepped if t.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coefficient)

    def _device(self) -> torch.device:
        return self.stepped[0].device if self.stepped else torch.device("cpu")


def _key(piece) -> BoxKey:
    return piece.name, piece.offsets, tuple(piece.view.shape)


def _owners(keys: list[list[BoxKey]], group: dist.ProcessGroup) -> dict[BoxKey, int]:
    """The lowest rank that holds each box (once, as the module is built: the boxes a
    rank holds do not change from step to step)."""
    mine = sorted({k for boxes in keys for k in boxes})
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return dict.fromkeys(mine, dist.get_rank() if dist.is_initialized() else 0)
    everyone: list[list[BoxKey] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    ranks = dist.get_process_group_ranks(group)
    owner: dict[BoxKey, int] = {}
    for rank, boxes in sorted(zip(ranks, everyone)):
        for k in boxes or ():
            owner.setdefault(k, rank)
    return owner
