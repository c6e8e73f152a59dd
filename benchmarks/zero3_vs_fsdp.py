"""autopart's ZeRO-3 against FSDP2 (`torch.distributed.fsdp.fully_shard`), same run.

    python benchmarks/zero3_vs_fsdp.py [--world 2] [--steps 30]

Both shard the same Llama-style model over every rank and train it with AdamW on the
same global batch, over Gloo on local CPU processes. FSDP2 gets the usual recipe: each
decoder layer sharded on its own, then the root (embedding, final norm and head), which
groups parameters as autopart's ZeRO-3 buckets do, with explicit forward and backward
prefetch of the next layer. Steps alternate between the two in rounds, so drift in
machine load hits both alike. Prints one JSON line: each median step time and
autopart / FSDP2. The ratio is specific to CPU processes over Gloo, where collectives
take the cores compute uses; on GPUs with NCCL both overlap differently.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable

import torch
import torch.distributed as dist
from dp_vs_ddp import build_model
from harness import (
    Step,
    comparison_options,
    global_mean_loss,
    lm_loss,
    run_comparison,
    this_ranks_rows,
    time_against_native,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import autopart


def adamw(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


def fsdp_baseline(pm: autopart.ParallelModule, ids: torch.Tensor, target: torch.Tensor) -> Step:
    """An FSDP2 step on this rank's share of the batch, each decoder layer and then the
    root sharded over every rank."""
    fsdp = build_model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    layers = list(fsdp.model.layers)
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    # Explicit prefetch, one layer ahead in each direction, as autopart's ZeRO-3 gathers.
    for i, layer in enumerate(layers):
        if i + 1 < len(layers):
            layer.set_modules_to_forward_prefetch([layers[i + 1]])
        if i > 0:
            layer.set_modules_to_backward_prefetch([layers[i - 1]])
    fsdp_opt = adamw(fsdp.parameters())
    local = this_ranks_rows(ids.shape[0])

    def fsdp_step() -> float:
        loss = lm_loss(fsdp(ids[local]), target[local])
        loss.backward()
        fsdp_opt.step()
        fsdp_opt.zero_grad()
        return global_mean_loss(loss)

    return fsdp_step


def _bench(args: argparse.Namespace) -> dict:
    return time_against_native(args, build_model, adamw, fsdp_baseline, dp=args.world, zero=3)


def main() -> None:
    args = comparison_options(__doc__, steps=30, rounds=3, batch=8, seq=64).parse_args()
    run_comparison(_bench, args, "zero3_vs_fsdp2", target_ratio=1.05)


if __name__ == "__main__":
    main()
