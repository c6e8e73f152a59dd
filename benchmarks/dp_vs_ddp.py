"""autopart's data parallelism against torch DistributedDataParallel, same run.

    python benchmarks/dp_vs_ddp.py [--world 2] [--steps 30]

Both train the same Llama-style model on the same global batch over Gloo on local CPU
processes; DDP with an expert's settings, `gradient_as_bucket_view=True` and
`broadcast_buffers=False`. Steps alternate between the two in rounds, so drift in
machine load hits both alike. Prints one JSON line: each median step time and
autopart / DDP.
"""

from __future__ import annotations

import argparse

import torch
from harness import (
    Step,
    comparison_options,
    global_mean_loss,
    llama,
    lm_loss,
    run_comparison,
    sgd,
    this_ranks_rows,
    time_against_native,
)
from torch.nn.parallel import DistributedDataParallel
from transformers import LlamaForCausalLM

import autopart


def build_model() -> LlamaForCausalLM:
    return llama(
        hidden=256, intermediate=512, layers=4, heads=4, kv_heads=4, vocab=2048, positions=64
    )


def ddp_baseline(
    pm: autopart.ParallelModule, ids: torch.Tensor, target: torch.Tensor, compiled: bool = False
) -> Step:
    """A DDP step on this rank's share of the batch; with `compiled`, over the DDP
    module compiled whole, as a DDP user compiles it."""
    # An expert's settings: gradients as views into the buckets (no copy into them),
    # and no buffer broadcast before each forward (the model's buffers never change).
    ddp = DistributedDataParallel(
        build_model(), gradient_as_bucket_view=True, broadcast_buffers=False
    )
    forward = torch.compile(ddp) if compiled else ddp
    ddp_opt = sgd(ddp.parameters())
    local = this_ranks_rows(ids.shape[0])

    def ddp_step() -> float:
        ddp_opt.zero_grad()
        loss = lm_loss(forward(ids[local]), target[local])
        loss.backward()
        ddp_opt.step()
        return global_mean_loss(loss)

    return ddp_step


def _bench(args: argparse.Namespace) -> dict:
    return time_against_native(args, build_model, sgd, ddp_baseline, dp=args.world, zero=0)


def main() -> None:
    args = comparison_options(__doc__, steps=30, rounds=3, batch=8, seq=64).parse_args()
    run_comparison(_bench, args, "dp_vs_ddp", target_ratio=1.05)


if __name__ == "__main__":
    main()
