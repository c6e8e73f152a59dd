"""Weights for models built on the meta device, and distributed checkpoints.

A model too large for one machine is built with `init_empty_weights()` (parameters on
the meta device, buffers real) and captured as it is; after the rewrite each rank
materializes only its own pieces (passes/materialize.py). `save_checkpoint(pm, path)`
writes the model's whole parameters in the format that pass reads.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn


@contextlib.contextmanager
def init_empty_weights() -> Iterator[None]:
    """Build modules with parameters on the meta device and buffers real (buffers such
    as rotary frequencies are computed in __init__ and are often not in checkpoints)."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            module._parameters[name] = meta

    # setattr: mypy rightly refuses to assign to a method; this is a deliberate patch.
    setattr(nn.Module, "register_parameter", register_on_meta)  # noqa: B010
    try:
        yield
    finally:
        setattr(nn.Module, "register_parameter", register)  # noqa: B010


def save_checkpoint(pm, path: str | os.PathLike) -> None:
    """Write the model's whole parameters as a distributed checkpoint (collective).
    Every rank passes the same whole tensors; the writer stores each once.

    The write is atomic: the checkpoint is written beside `path` (`<path>.partial`) and
    takes its place only once every rank has written, so a job that dies mid-write
    leaves the previous checkpoint at `path` whole (and a `.partial` the next save
    replaces). The swap itself is two renames on rank 0: between them the previous
    checkpoint is at `<path>.previous`."""
    final = Path(path)
    partial = final.with_name(final.name + ".partial")
    previous = final.with_name(final.name + ".previous")
    state = pm.full_state_dict()
    leader = not dist.is_initialized() or dist.get_rank() == 0
    if leader:
        shutil.rmtree(partial, ignore_errors=True)  # what an earlier, interrupted save left
    _barrier()
    dcp.save(state, checkpoint_id=str(partial))
    _barrier()  # every rank's files are written
    if leader:
        shutil.rmtree(previous, ignore_errors=True)
        if final.exists():
            final.rename(previous)
        partial.rename(final)
        shutil.rmtree(previous, ignore_errors=True)
    _barrier()


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
