"""ZeRO under an unchanged training loop: the user's optimizer steps the user's own
parameters, so ZeRO shards by whole parameters, each with one owner in the world.

Under `torch.compile` the parameters are the user's `nn.Parameter` objects: the user's
optimizer holds them, and dynamo guards their shapes. Flat shards (the runtime's ZeRO)
would need other tensors, so here each parameter keeps its shape and has an owner
(`runtime.zero_owners.owners`, the same on every rank); only the owner's optimizer
steps it, because only the owner holds its gradient when the step runs, and an
optimizer skips a parameter without one. This is exact for every optimizer, elementwise
or not.

- stage 1: gradients are all-reduced as under data parallelism (so every rank may read
  them, to clip for instance); just before the step the other ranks drop theirs, so
  only the owner's optimizer steps the parameter and holds its state. The owner then
  broadcasts the updated parameter.
- stage 2: each gradient is reduced onto its owner as soon as backward completes it and
  freed at once elsewhere; the owner broadcasts after the step.
- stage 3: as stage 2, and a parameter's memory lives on its owner only. The graph
  gathers it (a broadcast from the owner) right before its first use and frees it after
  its last use in forward; what autograd saves of it for backward is kept as a handle
  that gathers it again when backward needs it, freed once its gradient is complete.
  Outside forward and backward, read the parameters inside `gathered(model)`: a freed
  parameter keeps its shape (dynamo guards it) but has no memory to read.

A later backward adds to the gradients an earlier one left (accumulation without
`zero_grad`), as on one device.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from autopart.ops.aten import VIEW_OPS, op_name
from autopart.runtime.grad_sync import GradientSync
from autopart.runtime.parallel_module import ParallelModule
from autopart.runtime.zero_owners import OwnedParameters, broadcast_from_owners, owners

_Sync = GradientSync | OwnedParameters


class ParameterGradients:
    """Averages the gradients of `params` (in backward order) over `group` under ZeRO
    `stage` 0 to 3 (0: plain data parallelism), driven by the model's own forward and
    backward, and by the user's optimizer steps (`before_step`, `after_step`)."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup, stage: int) -> None:
        self.params, self.stage = params, stage
        self.group = group
        size = dist.get_world_size(group)
        global_rank = [dist.get_global_rank(group, r) for r in range(size)]
        self.owner = {id(p): global_rank[r] for p, r in owners(params, size)}
        me = dist.get_rank()
        self.mine = {id(p) for p in params if self.owner[id(p)] == me}
        self.sync: _Sync = (
            GradientSync(params, group)
            if stage <= 1
            else OwnedParameters(params, group, accumulation=1, stage=2)
        )
        self.storage = OwnerStorage(params, self.owner, group) if stage == 3 else None
        self._carry: dict[int, torch.Tensor] = {}
        self._queued = False
        trainable = [p for p in params if p.requires_grad]
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in trainable]
        _SYNCS.add(self)

    def begin(self) -> None:
        """Before a forward that will need gradients: keep what earlier backward passes
        left in the gradients (the sync reuses their memory), and arm the sync."""
        for p in self.params:
            if p.grad is not None:
                kept = self._carry.get(id(p))
                grad = p.grad.clone() if self.stage <= 1 else p.grad  # stage <= 1: a bucket view
                self._carry[id(p)] = grad if kept is None else kept.add_(grad)
        self.sync.begin()
        self._queued = False

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._queued = True
        if self.storage is not None:
            self.storage.release(p)

    def _finish(self) -> None:
        self.sync.finish()
        for p in self.params:
            carried = self._carry.pop(id(p), None)
            if carried is None:
                continue
            p.grad = carried if p.grad is None else p.grad.add_(carried)
        if self.storage is not None:
            self.storage.release_all()

    def before_step(self, stepped: Iterable[nn.Parameter]) -> None:
        """Stage 1: only the owner keeps the gradient, so only its optimizer steps."""
        if self.stage == 1:
            for p in stepped:
                if id(p) not in self.mine:
                    p.grad = None

    def after_step(self, stepped: Iterable[nn.Parameter]) -> None:
        """Stages 1 and 2: every rank again holds every parameter, from its owner."""
        if self.stage in (1, 2):
            broadcast_from_owners(stepped, self.owner, self.group)

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.sync.close()


@dataclass(frozen=True)
class _Saved:
    """A tensor autograd saved that is (a view of) a parameter held by its owner."""

    param: nn.Parameter
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class OwnerStorage:
    """ZeRO-3's memory: the parameters this rank does not own hold no storage except
    while a computation uses them.

    Whether a parameter is gathered is tracked alike on every rank, the owner included,
    since each gather is a broadcast they all take part in; only the memory differs."""

    def __init__(
        self, params: list[nn.Parameter], owner: dict[int, int], group: dist.ProcessGroup
    ) -> None:
        self.owner, self.group = owner, group
        me = dist.get_rank()
        self.params = {id(p): p for p in params}
        # Only a parameter alone in its storage can give its memory back.
        self.remote = {id(p) for p in params if owner[id(p)] != me and _alone(p)}
        self._bytes = {id(p): p.untyped_storage().nbytes() for p in params}
        self._live: dict[int, nn.Parameter] = {}  # storage address -> gathered parameter
        self._gathered: set[int] = set()
        for p in params:
            self._free(p)
        _STORAGES.add(self)

    def gather(self, p: nn.Parameter) -> nn.Parameter:
        """`p` whole on this rank, broadcast from its owner unless already gathered."""
        if id(p) not in self._gathered:
            with torch.no_grad():
                if id(p) in self.remote:
                    p.untyped_storage().resize_(self._bytes[id(p)])
                dist.broadcast(p.data, src=self.owner[id(p)], group=self.group)
            self._gathered.add(id(p))
            self._live[p.untyped_storage().data_ptr()] = p
        return p

    def release(self, p: torch.Tensor) -> None:
        if id(p) in self._gathered:
            self._live.pop(p.untyped_storage().data_ptr(), None)
            self._gathered.discard(id(p))
            self._free(p)

    def release_all(self) -> None:
        for p in self.params.values():
            self.release(p)

    def _free(self, p: torch.Tensor) -> None:
        if id(p) in self.remote:
            p.untyped_storage().resize_(0)

    def saving(self) -> AbstractContextManager[Any]:
        """Around a forward: what autograd saves of a gathered parameter becomes a
        handle that gathers it again in backward, so forward can free it after its last
        use. Every rank saves handles alike, so backward's gathers match."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        if not self._live or t.layout != torch.strided or t.device.type == "meta":
            return t
        p = self._live.get(t.untyped_storage().data_ptr())
        if p is None:
            return t
        return _Saved(p, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved
        p = self.gather(saved.param)
        return p.detach().as_strided(saved.size, saved.stride, saved.offset)


_STORAGES: weakref.WeakSet[OwnerStorage] = weakref.WeakSet()
_SYNCS: weakref.WeakSet[ParameterGradients] = weakref.WeakSet()


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for a model compiled with
    `autopart.backend(zero=2)` or `zero=3`, where each rank holds the gradients of the
    parameters it owns only: the norm is summed over the world first, so every rank
    clips by the norm of the whole gradient, as one device does. Collective: every rank
    calls it. Returns that norm.

    A ParallelModule clips inside its step, where the gradients are final and before
    the optimizer steps them: `parallelize(..., max_grad_norm=...)`."""
    if isinstance(model, ParallelModule):
        raise TypeError(
            "autopart.clip_grad_norm_ serves models compiled with backend='autopart'. A "
            "ParallelModule clips inside train_step, after the gradient sync and before "
            "the optimizer step: pass max_grad_norm=... to autopart.parallelize, and read "
            "each step's norm before clipping from pm.grad_norm"
        )
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    device = params[0].device if params else torch.device("cpu")
    local = (
        torch.nn.utils.get_total_norm(grads, norm_type) if grads else torch.zeros((), device=device)
    )
    mine = {id(p) for p in params}
    sharded = [s for s in _SYNCS if s.stage >= 2 and any(id(p) in mine for p in s.params)]
    if sharded and norm_type != float("inf"):
        power = local.to(torch.float64) ** norm_type
        dist.all_reduce(power, group=sharded[0].group)
        total = (power ** (1.0 / norm_type)).to(local.dtype)
    elif sharded:
        total = local.clone()
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=sharded[0].group)
    else:
        total = local
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)  # scales their .grad
    return total


@contextmanager
def gathered(model: nn.Module) -> Iterator[nn.Module]:
    """Every parameter of `model` whole on every rank inside the block, for reading
    (`state_dict()`, saving, printing): under ZeRO-3 a rank holds only the parameters it
    owns outside forward and backward, and the others' memory is given back. Collective:
    every rank enters the block."""
    mine = {id(p) for p in model.parameters()}
    storages = [s for s in _STORAGES if any(i in mine for i in s.params)]
    with torch.no_grad():
        for storage in storages:
            for i, p in storage.params.items():
                if i in mine:
                    storage.gather(p)
    try:
        yield model
    finally:
        for storage in storages:
            storage.release_all()


def _alone(p: nn.Parameter) -> bool:
    """Whether `p` is the whole of its storage (not a view into a larger buffer)."""
    return (
        p.is_contiguous()
        and p.storage_offset() == 0
        and p.untyped_storage().nbytes() == p.numel() * p.element_size()
    )


class _Gather(nn.Module):
    def __init__(self, storage: OwnerStorage) -> None:
        super().__init__()
        self.storage = storage

    def forward(self, p: nn.Parameter) -> nn.Parameter:
        return self.storage.gather(p)


class _Release(nn.Module):
    def __init__(self, storage: OwnerStorage) -> None:
        super().__init__()
        self.storage = storage

    def forward(self, p: nn.Parameter) -> None:
        self.storage.release(p)


# Operators whose output may share its input's memory: a parameter stays gathered
# until the last use of any of them.
_ALIASING = VIEW_OPS | {"to", "type_as", "getattr"}


def gather_on_use(gm: fx.GraphModule, params: list[fx.Node], storage: OwnerStorage) -> None:
    """ZeRO-3 in `gm`: each parameter input in `params` is gathered right before its
    first use and released right after the last use of it or of a view of it."""
    gm.add_submodule("autopart_gather", _Gather(storage))
    gm.add_submodule("autopart_release", _Release(storage))
    graph = gm.graph
    gathered: dict[fx.Node, fx.Node] = {}
    for node in params:
        if not node.users:
            continue
        first = min(node.users, key=_position(graph))
        with graph.inserting_before(first):
            gather = gathered[node] = graph.call_module("autopart_gather", (node,))
        node.replace_all_uses_with(gather, delete_user_cb=_all_but(gather))
    position = _position(graph)
    for node, gather in gathered.items():
        users = [u for alias in _aliases(gather) for u in alias.users]
        last = max(users, key=position)
        if last.op == "output":
            continue  # the forward returns it: it stays until backward
        with graph.inserting_after(last):
            graph.call_module("autopart_release", (node,))
    graph.lint()
    gm.recompile()


def _all_but(gather: fx.Node) -> Callable[[fx.Node], bool]:
    """The uses of a parameter to hand to its gather: all but the gather's own."""
    return lambda user: user is not gather


def _position(graph: fx.Graph) -> Any:
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order.__getitem__


def _aliases(node: fx.Node) -> list[fx.Node]:
    """`node` and every node that may view its memory, transitively."""
    out, todo = [node], [node]
    while todo:
        for user in todo.pop().users:
            name = op_name(user) if user.op in ("call_function", "call_method") else ""
            if name in _ALIASING and user not in out:
                out.append(user)
                todo.append(user)
    return out
