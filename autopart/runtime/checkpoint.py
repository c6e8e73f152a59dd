"""Sharded checkpoints of a ParallelModule: parameters and optimizer state, resumable
under another plan.

Every rank writes only what it holds and reads only what it will hold, through
torch.distributed.checkpoint (dcp_planners.py); nothing is gathered whole. Entries are
named as on one device, so the files do not depend on the plan that wrote them:

    <fqn>                       a parameter, in pieces (pieces.py)
    optimizer/<fqn>/<key>       the optimizer's state of that parameter: shaped like it
                                (Adam's moments) in pieces; a scalar (Adam's step);
                                or another shape, for a parameter held whole (Adafactor's
                                row and column statistics)
    optimizer/param_groups      the groups' settings (learning rate, betas...)
    optimizer/lr_scheduler      the learning-rate scheduler's state, where one is given
    autopart/steps              training steps taken; autopart/loss_scale for fp16

A ZeRO flat shard spans many parameters: its scalar state (the step) is written under
each of them and read back from the bucket's first. Whatever the plan, a parameter's
pieces cover it exactly once, so a checkpoint loads under any plan of the same model,
with every optimizer's moments and step counts as they were.

Writes are atomic: the checkpoint is written beside `path` (`<path>.partial`) and takes
its place once every rank has written, so a job that dies mid-write leaves the previous
checkpoint whole at `path`.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.optim.lr_scheduler import LRScheduler

from autopart.runtime.dcp_planners import LoadPieces, PieceState, SavePieces
from autopart.runtime.holdings import Held, Holdings
from autopart.runtime.pieces import Piece, distinct

if TYPE_CHECKING:
    from autopart.runtime.parallel_module import ParallelModule

OPTIMIZER = "optimizer"
PARAM_GROUPS = "optimizer/param_groups"
SCHEDULER = "optimizer/lr_scheduler"
STEPS = "autopart/steps"
LOSS_SCALE = "autopart/loss_scale"


class CheckpointError(ValueError):
    """A checkpoint that does not belong to this model, or state it cannot hold."""


def _stepped(pm: ParallelModule) -> list[tuple[torch.Tensor, dict[str, Any], dict[str, Any]]]:
    """(tensor, its state, its group) for every tensor the optimizer steps."""
    optimizer = pm.optimizer
    if optimizer is None:
        return []
    groups = optimizer.param_groups
    return [(t, optimizer.state[t], group) for group in groups for t in group["params"]]


# -- saving ------------------------------------------------------------------------------


def _to_save(pm: ParallelModule, scheduler: LRScheduler | None) -> PieceState:
    holdings = Holdings(pm)
    state: PieceState = dict(holdings.parameters(loading=False))
    entries: dict[str, list[Piece]] = {}
    stepped = _stepped(pm)
    scalars = {
        key
        for tensor, values, _ in stepped
        if tensor.dim() > 0
        for key, value in values.items()
        if isinstance(value, torch.Tensor) and value.dim() == 0
    }
    for tensor, values, _ in stepped:
        held = holdings.of(tensor)
        for key, value in values.items():
            for piece in _state_pieces(held, tensor, key, value, key in scalars):
                entries.setdefault(piece.name, []).append(piece)
    state.update((name, distinct(pieces)) for name, pieces in entries.items())
    if pm.optimizer is not None:
        state[PARAM_GROUPS] = [
            {k: v for k, v in group.items() if k != "params"} for group in pm.optimizer.param_groups
        ]
    if scheduler is not None:
        state[SCHEDULER] = scheduler.state_dict()
    state[STEPS] = pm.steps
    if pm.precision.scaler is not None:
        state[LOSS_SCALE] = pm.precision.scaler.value
    return state


def _state_pieces(
    held: Held, tensor: torch.Tensor, key: str, value: Any, scalar: bool
) -> list[Piece]:
    """`value`, the state `key` of `tensor`, as pieces: one number per parameter where
    the key is a scalar (Adam's step: 0-dim beside any parameter with dims, so a 0-dim
    parameter's step is not taken for state shaped like it); where `tensor`'s pieces
    lie, for state shaped like it; else whole, for a parameter held whole."""
    if value is None:  # nothing kept (SGD's momentum buffer without momentum)
        return []
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(
            f"the optimizer's state {key!r} is a {type(value).__name__}, not a tensor: "
            "autopart checkpoints tensor state only"
        )
    value = value.detach()
    if scalar or (value.dim() == 0 and tensor.dim() > 0):
        return [Piece(f"{OPTIMIZER}/{name}/{key}", (), (), value) for name in held.names]
    if value.shape == tensor.shape:
        return [replace(p, name=f"{OPTIMIZER}/{p.name}/{key}") for p in held.pieces(value)]
    if not held.whole:
        raise CheckpointError(
            f"the optimizer's state {key!r} of {held.names[0]} has shape "
            f"{tuple(value.shape)}, unlike the parameter's piece {tuple(tensor.shape)}: "
            "state of its own shape is checkpointed only for parameters held whole "
            "(no tensor parallelism over them, no ZeRO-3)"
        )
    name = held.names[0]
    return [Piece(f"{OPTIMIZER}/{name}/{key}", tuple(value.shape), (0,) * value.dim(), value)]


def save_checkpoint(
    pm: ParallelModule, path: str | os.PathLike, *, scheduler: LRScheduler | None = None
) -> None:
    """Write `pm`'s parameters and optimizer state as a sharded distributed checkpoint
    (collective: every rank calls it, and writes only its own pieces). It loads under
    any plan of the same model (`load_checkpoint`), and as `weights=` of `parallelize`.
    With the learning-rate `scheduler` stepping `pm.optimizer`, its state is saved too
    (its `state_dict()`: the step it is at, the base rates), so that a resumed run goes
    on along its schedule instead of starting its warm-up again.

    The write is atomic: the checkpoint is written beside `path` (`<path>.partial`) and
    takes its place only once every rank has written, so a job that dies mid-write
    leaves the previous checkpoint at `path` whole (and a `.partial` the next save
    replaces). The swap itself is two renames on rank 0: between them the previous
    checkpoint is at `<path>.previous`."""
    final = Path(path)
    partial = final.with_name(final.name + ".partial")
    previous = final.with_name(final.name + ".previous")
    state = _to_save(pm, scheduler)
    leader = not dist.is_initialized() or dist.get_rank() == 0
    if leader:
        shutil.rmtree(partial, ignore_errors=True)  # what an earlier, interrupted save left
    _barrier()
    dcp.save(state, checkpoint_id=str(partial), planner=SavePieces())
    _barrier()  # every rank's files are written
    if leader:
        shutil.rmtree(previous, ignore_errors=True)
        if final.exists():
            final.rename(previous)
        partial.rename(final)
        shutil.rmtree(previous, ignore_errors=True)
    _barrier()


# -- loading -----------------------------------------------------------------------------


def load_checkpoint(
    pm: ParallelModule, path: str | os.PathLike, *, scheduler: LRScheduler | None = None
) -> None:
    """Load a checkpoint written by `save_checkpoint`, under this plan or any other of
    the same model, into `pm`'s parameters and optimizer state (collective). Training
    then goes on as if it had never stopped. A `scheduler` built over `pm.optimizer`
    (fresh: its construction set the first rate) takes the saved scheduler's state,
    after the optimizer's groups take theirs, so the groups' rates are the ones the
    saved scheduler last set; a checkpoint saved without one is refused."""
    if not Path(path).is_dir():
        raise CheckpointError(f"{path}: no checkpoint there (save_checkpoint writes a directory)")
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    if scheduler is not None and SCHEDULER not in metadata.state_dict_metadata:
        raise CheckpointError(
            f"{path} holds no learning-rate scheduler's state: it was saved without "
            "save_checkpoint(..., scheduler=...); load it without scheduler=, and set the "
            "scheduler to its step yourself"
        )
    holdings = Holdings(pm)
    state: PieceState = dict(holdings.parameters(loading=True))
    _check_parameters(state, metadata, path)
    scalars = _scalar_keys(metadata)
    for tensor, values, group in _stepped(pm):
        held = holdings.of(tensor)
        state.update(_state_request(held, tensor, values, group, metadata, scalars))
    extras = [PARAM_GROUPS, STEPS, LOSS_SCALE] + ([SCHEDULER] if scheduler is not None else [])
    state.update((k, None) for k in extras if k in metadata.state_dict_metadata)
    planner = LoadPieces()
    dcp.load(state, checkpoint_id=str(path), planner=planner)
    _restore_extras(pm, planner.objects)
    if scheduler is not None:  # after the groups: it reads none of them, sets no rate
        scheduler.load_state_dict(planner.objects[SCHEDULER])


def _check_parameters(state: PieceState, metadata: Metadata, path: str | os.PathLike) -> None:
    """Refuse, on every rank alike (before the collective load, which would otherwise
    wait on a rank that stopped), a checkpoint whose parameters are not this model's:
    one missing, of another shape, or one this model does not have."""
    stored = metadata.state_dict_metadata
    problem = None
    for name, pieces in state.items():
        entry = stored.get(name)
        if entry is None or isinstance(entry, BytesStorageMetadata):
            problem = f"{path} has no parameter {name!r}: it was saved from another model"
        elif tuple(entry.size) != pieces[0].size:
            problem = (
                f"{path} holds {name!r} with shape {tuple(entry.size)}, but this model's is "
                f"{pieces[0].size}: it was saved from another model"
            )
        if problem:
            break
    reports = [(problem, set(state))]
    if dist.is_initialized() and dist.get_world_size() > 1:
        reports = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(reports, (problem, set(state)))
    problems = [p for p, _ in reports if p]
    if problems:
        raise CheckpointError(problems[0])
    loaded = set().union(*(names for _, names in reports))
    extra = sorted(n for n in stored if "/" not in n and n not in loaded)
    if extra:
        raise CheckpointError(
            f"{path} holds {len(extra)} parameters this model does not have (e.g. "
            f"{extra[0]!r}): it was saved from another model"
        )


def _scalar_keys(metadata: Metadata) -> set[str]:
    """The optimizer's scalar state keys: 0-dim beside a parameter that has dims."""
    stored = metadata.state_dict_metadata
    out = set()
    for name, entry in stored.items():
        if not name.startswith(f"{OPTIMIZER}/") or isinstance(entry, BytesStorageMetadata):
            continue
        fqn, _, key = name[len(OPTIMIZER) + 1 :].rpartition("/")
        parameter = stored.get(fqn)
        if len(entry.size) == 0 and getattr(parameter, "size", ()) != torch.Size(()):
            out.add(key)
    return out


def _state_request(
    held: Held,
    tensor: torch.Tensor,
    values: dict[str, Any],
    group: dict[str, Any],
    metadata: Metadata,
    scalars: set[str],
) -> PieceState:
    """The entries to read for `tensor`'s optimizer state, after creating that state
    (as its optimizer would on its first step) in `values`."""
    prefix = f"{OPTIMIZER}/{held.names[0]}/"
    request: dict[str, list[Piece]] = {}
    for name, entry in metadata.state_dict_metadata.items():
        if not name.startswith(prefix):
            continue
        key = name[len(prefix) :]
        assert not isinstance(entry, BytesStorageMetadata), "state is saved as tensors"
        dtype = entry.properties.dtype
        if key in scalars:
            on_device = group.get("capturable") or group.get("fused")
            values[key] = torch.zeros((), dtype=dtype, device=tensor.device if on_device else "cpu")
            request[name] = [Piece(name, (), (), values[key])]
        elif tuple(entry.size) == held.first_size:
            values[key] = torch.zeros_like(tensor, dtype=dtype)
            for p in held.pieces(values[key]):
                request.setdefault(f"{OPTIMIZER}/{p.name}/{key}", []).append(p)
        elif held.whole:
            values[key] = torch.zeros(entry.size, dtype=dtype, device=tensor.device)
            request[name] = [Piece(name, tuple(entry.size), (0,) * len(entry.size), values[key])]
        else:
            raise CheckpointError(
                f"{name} has shape {tuple(entry.size)}, unlike its parameter: this plan "
                "holds that parameter in pieces (tensor parallelism or ZeRO-3), which "
                "cannot take state of its own shape; load it under a plan that keeps the "
                "parameter whole"
            )
    return dict(request)


def _restore_extras(pm: ParallelModule, objects: dict[str, Any]) -> None:
    if PARAM_GROUPS in objects and pm.optimizer is not None:
        saved, groups = objects[PARAM_GROUPS], pm.optimizer.param_groups
        if len(saved) not in (1, len(groups)):
            raise CheckpointError(
                f"the checkpoint's optimizer has {len(saved)} parameter groups, this one "
                f"{len(groups)}: autopart cannot tell which settings go where"
            )
        for i, group in enumerate(groups):
            group.update(saved[i if len(saved) == len(groups) else 0])
    if STEPS in objects:
        pm.steps = objects[STEPS]
    if LOSS_SCALE in objects and pm.precision.scaler is not None:
        pm.precision.scaler.value = objects[LOSS_SCALE]


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
