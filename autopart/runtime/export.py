"""A trained ParallelModule back to one device: the whole model's state dict on disk.

`export(pm, directory)` gathers every parameter whole (`pm.full_state_dict()`) and rank
0 writes it as `pytorch_model.bin`, with the model's Hugging Face config beside it
when given, the layout `from_pretrained` reads. Unlike `save_checkpoint`, this gathers:
it is for handing the model on, at a size one host can hold.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from autopart.runtime.parallel_module import ParallelModule

WEIGHTS_NAME = "pytorch_model.bin"


def export(pm: ParallelModule, directory: str | os.PathLike, config: Any = None) -> Path:
    """Write `pm`'s whole parameters (on CPU, named as on one device) to
    `directory/pytorch_model.bin`, and `config.save_pretrained(directory)` when a
    config is given (collective: every rank calls it; rank 0 writes). Returns the file."""
    state = {name: t.detach().cpu() for name, t in pm.full_state_dict().items()}
    path = Path(directory) / WEIGHTS_NAME
    if not dist.is_initialized() or dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)
        if config is not None:
            config.save_pretrained(directory)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    return path
