"""Weights for each rank's pieces of each stage. A model built on the meta device gets
real memory for them; a real model given `weights` has its parameters overwritten.
Each rank reads only its own pieces, from either

- a state dict of whole tensors (`torch.load(path, mmap=True)` keeps it on disk): each
  rank copies its slice of each parameter; or
- a `torch.distributed.checkpoint` directory: each tensor-parallel parameter is loaded
  as a DTensor with its placement, so the reader fetches only this rank's slice
  (a fused q/k/v weight, sharded part by part, is read whole and sliced).

Without `weights`, a real model passes through untouched and a meta one is an error.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
import torch.distributed.checkpoint as dcp
from torch import fx, nn
from torch.distributed.tensor import DTensor, Shard

from autopart.ops.meta import TP_LAYOUT
from autopart.ops.shards import local_shard
from autopart.passes.runner import PassContext

Weights = Mapping[str, torch.Tensor] | str | os.PathLike


class WeightsError(ValueError):
    """Weights that do not fit the model."""


def materialize_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Give the stage this rank's piece of the target's weights, on this rank's device:
    every meta parameter and buffer is replaced by real memory, and, when weights are
    given, every real parameter is overwritten in place (a real buffer keeps the value
    the model computed). Without weights, a real model passes through untouched."""
    weights, groups = ctx.rank.weights, ctx.rank.groups
    tensors = [
        (gm, name, t)
        for name, t in _tensors(gm)
        # Trainable buffers are a later pipeline stage's replicas of tied weights.
        if t.is_meta or (weights is not None and (isinstance(t, nn.Parameter) or t.requires_grad))
    ]
    if not tensors:
        return gm
    tp_layout, tp_mesh = TP_LAYOUT.get(gm, {}), groups.tp_mesh
    if weights is None:
        raise WeightsError(
            f"the model has {len(tensors)} tensors on the meta device (e.g. {tensors[0][1]!r}):"
            " pass parallelize(..., weights=state_dict or checkpoint directory)"
        )
    if isinstance(weights, Mapping):
        loaded = {name: _slice(weights, name, t, tp_layout, tp_mesh) for _, name, t in tensors}
    else:
        loaded = _load_checkpoint(str(weights), tensors, tp_layout, tp_mesh)
    for gm, name, t in tensors:
        if t.is_meta:
            _replace(gm, name, loaded[name].to(groups.device), t)
        else:  # the model's own parameter (or this rank's shard of it): keep the object
            with torch.no_grad():
                t.copy_(loaded[name])
    return gm


def _tensors(gm: fx.GraphModule):
    yield from gm.named_parameters()
    yield from gm.named_buffers()


def _aliases(gm: fx.GraphModule, tensor: torch.Tensor) -> list[str]:
    """Every attribute path that holds `tensor` (tied weights have several)."""
    params = gm.named_parameters(remove_duplicate=False)
    buffers = gm.named_buffers(remove_duplicate=False)
    return [name for name, t in [*params, *buffers] if t is tensor]


def _slice(weights, name, target, tp_layout, tp_mesh) -> torch.Tensor:
    if name not in weights:
        raise WeightsError(
            f"the weights have no entry {name!r} (shape {tuple(target.shape)}), which this "
            "rank needs: pass the model's full state dict (parameters and buffers)"
        )
    full = weights[name]
    if name in tp_layout:
        dim, parts = tp_layout[name]
        full = local_shard(full, dim, tp_mesh.size(), tp_mesh.get_local_rank(), parts)
    if tuple(full.shape) != tuple(target.shape):
        raise WeightsError(
            f"{name}: the weights hold shape {tuple(weights[name].shape)}, which does not "
            f"give this rank's piece {tuple(target.shape)}: they belong to another model"
        )
    return full.to(target.dtype)


def _load_checkpoint(path, tensors, tp_layout, tp_mesh) -> dict[str, torch.Tensor]:
    request: dict[str, torch.Tensor] = {}
    for _, name, t in tensors:
        dim, parts = tp_layout.get(name, (0, 0))
        local = torch.empty(t.shape, dtype=t.dtype)
        if parts == 1:
            request[name] = DTensor.from_local(local, tp_mesh, [Shard(dim)], run_check=False)
        elif parts > 1:  # fused: read whole, slice below
            whole = list(t.shape)
            whole[dim] *= tp_mesh.size()
            request[name] = torch.empty(whole, dtype=t.dtype)
        else:
            request[name] = local
    dcp.load(request, checkpoint_id=path)
    out = {}
    for name, value in request.items():
        if isinstance(value, DTensor):
            out[name] = value.to_local()
        elif name in tp_layout:
            dim, parts = tp_layout[name]
            out[name] = local_shard(value, dim, tp_mesh.size(), tp_mesh.get_local_rank(), parts)
        else:
            out[name] = value
    return out


def _replace(gm: fx.GraphModule, name: str, value: torch.Tensor, old: torch.Tensor) -> None:
    if isinstance(old, nn.Parameter):
        value = nn.Parameter(value, requires_grad=old.requires_grad)
    else:  # a pipeline stage's replica of a tied weight is a buffer that needs grad
        value.requires_grad_(old.requires_grad)
    for alias in _aliases(gm, old):
        module_path, _, leaf = alias.rpartition(".")
        module = gm.get_submodule(module_path) if module_path else gm
        if isinstance(old, nn.Parameter):
            setattr(module, leaf, value)
        else:
            module._buffers[leaf] = value
