"""Reassembling whole parameters from this rank's pieces (for checkpoints and checks).

Each layer of sharding is undone in the reverse order it was applied: ZeRO-3 over each
bucket's group (dp, or dp × ep), then expert parallelism over ep (each rank's run of
experts, cut from its tp slices), then tensor parallelism over tp, then the pipeline
over pp (each stage holds its own parameters, exchanged as objects). Where the model
holds 16-bit copies of fp32 master weights (on the host, or 16-bit parameters' masters
beside the optimizer), the copies are then overwritten by them, every rank's pieces
exchanged as objects.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from autopart.degrees import Axis
from autopart.ops import zero3
from autopart.ops.shards import unshard
from autopart.policy import PARAM_DTYPES, MasterWeights
from autopart.runtime.holdings import Holdings

if TYPE_CHECKING:
    from autopart.runtime.parallel_module import ParallelModule


def full_state_dict(pm: ParallelModule) -> dict[str, torch.Tensor]:
    full: dict[str, torch.Tensor] = {}
    for stage in pm.stages:
        full.update(zero3.full_state_dict(stage))
    full = _undo_tensor_parallel(pm, _undo_expert_parallel(pm, full))
    return _with_masters(pm, _gather_pipeline_stages(pm, full))


def _with_masters(pm: ParallelModule, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`params` with the master weights on the host in place of the device's 16-bit
    copies: every rank's pieces of them, gathered (each element is some rank's)."""
    host = pm.plan.master_weights == MasterWeights.HOST
    if not (host or pm.plan.precision in PARAM_DTYPES) or pm.state is None:
        return params  # (the same on every rank: a rank holding no masters gathers too)
    mine = [
        (piece.name, piece.offsets, piece.view.clone())
        for host, held in Holdings(pm).masters
        for piece in held.pieces(host.detach())
    ]
    every: list[list[tuple[str, tuple[int, ...], torch.Tensor]] | None] = [
        None
    ] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    for pieces in every:
        for name, offsets, view in pieces or ():
            params[name] = params[name].to(view.dtype)  # once: then it is the same tensor
            region = tuple(slice(o, o + n) for o, n in zip(offsets, view.shape))
            params[name][region] = view.to(params[name].device)
    return params


def _undo_tensor_parallel(
    pm: ParallelModule, params: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    if pm.plan.tp == 1:
        return params
    group = pm.groups.group(Axis.TP)
    for fqn, (dim, parts) in sorted(pm.tp_layout.items()):  # the same order on every rank
        if fqn not in params:
            continue
        local = params[fqn].contiguous()
        gathered = [torch.empty_like(local) for _ in range(pm.plan.tp)]
        dist.all_gather(gathered, local, group=group)
        params[fqn] = unshard(gathered, dim, parts)
    return params


def _undo_expert_parallel(
    pm: ParallelModule, params: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Each ep rank holds its run of every layer's experts (dim 0): concatenated in
    rank order."""
    if pm.plan.ep == 1:
        return params
    group = pm.groups.group(Axis.EP)
    for fqn in sorted(pm.ep_sharded):  # the same order on every rank
        if fqn not in params:
            continue
        local = params[fqn].contiguous()
        gathered = [torch.empty_like(local) for _ in range(pm.plan.ep)]
        dist.all_gather(gathered, local, group=group)
        params[fqn] = torch.cat(gathered, 0)
    return params


def _gather_pipeline_stages(
    pm: ParallelModule, params: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Each pipeline rank holds its own stages' parameters: every rank gets all of them
    (through the CPU, as objects, then back on this rank's device)."""
    if pm.plan.pp == 1:
        return params
    group = pm.groups.group(Axis.PP)
    pieces: list[dict[str, torch.Tensor] | None] = [None] * pm.plan.pp
    dist.all_gather_object(pieces, {k: v.cpu() for k, v in params.items()}, group=group)
    device = next(iter(params.values())).device if params else torch.device("cpu")
    gathered: dict[str, torch.Tensor] = {}
    for piece in pieces:
        assert piece is not None, "all_gather_object fills every entry"
        gathered.update((k, v.to(device)) for k, v in piece.items())
    return gathered
