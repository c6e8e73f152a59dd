"""Parameters read by several pipeline stages (tied embeddings), kept one parameter.

The split gives a shared parameter to the first stage that reads it (its owner) and a
replica to every later reader (see passes/stage_modules.py). Each step:

    begin()    the owner's value is copied into every replica (sent, where the reader
               runs on another rank)
    backward   when a replica has accumulated its last microbatch's gradient, the
               gradient goes to the owner at once, so no rank waits on another's schedule;
               a hook on the owner adds the replicas' gradients to its own last
               microbatch's gradient, before it is accumulated
    finish()   wait for the sends

The owner's last backward comes after every reader's (readers are later stages), so the
replicas' gradients are complete, or on their way, when the owner needs them. What
accumulates into the owner's `.grad` is then the single-device gradient, before any
post-accumulate hook (the data-parallel gradient sync) sees it. Each shared parameter
has a process group of its own: its messages cannot interleave with the pipeline's sends
and receives, or with another parameter's, on one communicator (NCCL matches by order).
Outside a step the hooks do nothing.

Values and gradients travel in the parameter's captured dtype (`_Shared.dtype`): with
master weights on the host the owner holds a 16-bit copy while the replicas, buffers,
keep that dtype (holding the copy's values, which its readers then read as they read
a widened weight, passes/master_weights.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import fx
from torch.utils.hooks import RemovableHandle

from autopart.degrees import Axis
from autopart.ops.groups import MeshGroups
from autopart.ops.stage_info import SharedParameter, pipeline_info


@dataclass
class _Shared:
    """One shared parameter as this rank sees it."""

    group: dist.ProcessGroup | None  # None: owner and readers share this rank
    owner_rank: int
    param: torch.Tensor | None  # the parameter, where this rank runs its owner
    replicas: dict[int, torch.Tensor]  # reader stage -> replica, for readers run here
    remote_readers: list[tuple[int, int]]  # (reader stage, global rank) run elsewhere
    dtype: torch.dtype  # of what travels: the parameter's, as captured
    arrivals: dict[int, int] = field(default_factory=dict)  # id(tensor) -> backward count


class SharedParameters:
    def __init__(
        self,
        stages: list[fx.GraphModule],
        stage_ids: list[int],
        groups: MeshGroups,
        microbatches: int,
    ) -> None:
        self.microbatches = microbatches
        self.active = False
        self.works: list[dist.Work] = []
        self.sending: list[torch.Tensor] = []
        self.hooks: list[RemovableHandle] = []
        pp_group = groups.group(Axis.PP)
        pp = groups.size(Axis.PP)
        ranks = [dist.get_global_rank(pp_group, i) for i in range(pp)]
        local = dict(zip(stage_ids, stages))
        self.shared = [
            self._prepare(s, local, ranks, groups) for s in pipeline_info(stages[0]).shared
        ]

    def _prepare(
        self,
        shared: SharedParameter,
        local: dict[int, fx.GraphModule],
        ranks: list[int],
        groups: MeshGroups,
    ) -> _Shared:
        rank_of = {s: ranks[s % len(ranks)] for s in (shared.owner, *shared.readers)}
        crosses = len(set(rank_of.values())) > 1
        param = local[shared.owner].get_parameter(shared.fqn) if shared.owner in local else None
        replicas = {r: local[r].get_buffer(shared.fqn) for r in shared.readers if r in local}
        entry = _Shared(
            group=_pp_groups_like(groups) if crosses else None,  # collective: every rank
            owner_rank=rank_of[shared.owner],
            param=param,
            replicas=replicas,
            remote_readers=[(r, rank_of[r]) for r in shared.readers if r not in local],
            dtype=next(
                (t.dtype for t in (param, *replicas.values()) if t is not None), torch.float32
            ),
        )
        if entry.param is not None and entry.param.requires_grad:
            self.hooks.append(entry.param.register_hook(lambda g, e=entry: self._owner_grad(e, g)))
        if entry.param is None:
            for replica in entry.replicas.values():
                if replica.requires_grad:
                    self.hooks.append(
                        replica.register_post_accumulate_grad_hook(
                            lambda t, e=entry: self._replica_grad(e, t)
                        )
                    )
        return entry

    def begin(self) -> None:
        """Before the step's first forward: replicas take the owner's value."""
        self.active = True
        for entry in self.shared:
            entry.arrivals.clear()
            for replica in entry.replicas.values():
                replica.grad = None
            if entry.param is not None:
                value = entry.param.detach().to(entry.dtype)
                for replica in entry.replicas.values():
                    replica.detach().copy_(value)
                for _, rank in entry.remote_readers:
                    self.works.append(_isend(value, rank, entry.group))
                self.sending.append(value)  # alive until its sends complete
        for entry in self.shared:
            if entry.param is None:
                for _, replica in sorted(entry.replicas.items()):
                    dist.recv(replica.detach(), entry.owner_rank, group=entry.group)

    def finish(self) -> None:
        """After the step's last backward: every send has completed."""
        for work in self.works:
            work.wait()
        self.works.clear()
        self.sending.clear()
        self.active = False

    def close(self) -> None:
        for handle in self.hooks:
            handle.remove()
        self.hooks.clear()

    def _last_arrival(self, entry: _Shared, tensor: torch.Tensor) -> bool:
        entry.arrivals[id(tensor)] = entry.arrivals.get(id(tensor), 0) + 1
        return self.active and entry.arrivals[id(tensor)] == self.microbatches

    def _replica_grad(self, entry: _Shared, replica: torch.Tensor) -> None:
        if self._last_arrival(entry, replica):
            assert replica.grad is not None, "a post-accumulate-grad hook sees the grad"
            self.works.append(_isend(replica.grad, entry.owner_rank, entry.group))

    def _owner_grad(self, entry: _Shared, grad: torch.Tensor) -> torch.Tensor:
        assert entry.param is not None, "the hook is on the owner's parameter"
        if not self._last_arrival(entry, entry.param):
            return grad
        # Later stages finish their backward first: receive in decreasing stage order,
        # the order a rank running several readers sends in.
        for _, rank in sorted(entry.remote_readers, reverse=True):
            incoming = torch.empty(grad.shape, dtype=entry.dtype, device=grad.device)
            dist.recv(incoming, rank, group=entry.group)
            grad = grad + incoming.to(grad.dtype)
        for replica in entry.replicas.values():
            if replica.grad is not None:
                grad = grad + replica.grad.to(grad.dtype)
        return grad


def _isend(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None) -> dist.Work:
    work = dist.isend(tensor, dst, group=group)
    assert work is not None, "this rank is in the group"  # isend returns None only outside it
    return work


def _pp_groups_like(groups: MeshGroups) -> dist.ProcessGroup:
    """A new process group over this rank's pp ranks. Every rank creates every pp
    group, in the same order (torch.distributed requires it), and keeps its own."""
    mesh = groups.device_mesh
    dim = groups.mesh_dim(Axis.PP)
    layout = mesh.mesh.movedim(dim, -1).reshape(-1, mesh.mesh.size(dim)).tolist()
    mine: dist.ProcessGroup | None = None
    for ranks in layout:
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    assert mine is not None, "the device mesh holds every rank"
    return mine
