"""autopart compiled (`parallelize(..., compile=True)`) against PyTorch-native compiled
training, same run.

    python benchmarks/compiled_vs_native.py --pair ddp    [--world 2] [--steps 30]
    python benchmarks/compiled_vs_native.py --pair fsdp2  [--world 2] [--steps 30]

    pair    autopart                               PyTorch-native baseline
    ddp     dp, compile=True                       DDP over `torch.compile(model)`
    fsdp2   ZeRO-3, precision="bf16-params",       `fully_shard` per block and at the
            compile=True                           root, `MixedPrecisionPolicy(bf16,
                                                   fp32)`, each block compiled

Both sides train the same Llama-style model on the same global batch over Gloo on local
CPU processes, inductor's C++ backend compiling each; the compile happens in the
warm-up steps, before the timing. Steps alternate between the two in rounds, so drift
in machine load hits both alike. Prints one JSON line: each median step time,
autopart / native and its value per round (the spread). The first losses agree within
inductor's reordering in fp32, and within bf16's resolution for the bf16 pair.
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.distributed as dist
from dp_vs_ddp import build_model, ddp_baseline
from harness import (
    Step,
    comparison_options,
    global_mean_loss,
    lm_loss,
    run_comparison,
    sgd,
    this_ranks_rows,
    time_against_native,
)

import autopart

ddp_compiled = functools.partial(ddp_baseline, compiled=True)
# Where the two sides' first losses may differ: inductor fuses and reorders fp32 sums;
# in bf16, one unit in the last place of the loss.
LOSS_RTOL = {"ddp": 1e-4, "fsdp2": 2.0**-7}


def fsdp2_compiled(pm: autopart.ParallelModule, ids: torch.Tensor, target: torch.Tensor) -> Step:
    """FSDP2 as torchtitan runs it: each block sharded and compiled on its own, then the
    root, parameters in bf16 and gradients reduced in fp32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build_model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, block in enumerate(model.model.layers):
        model.model.layers[i] = torch.compile(block)
        fully_shard(model.model.layers[i], mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = sgd(model.parameters())
    local = this_ranks_rows(ids.shape[0])

    def step() -> float:
        opt.zero_grad()
        loss = lm_loss(model(ids[local]), target[local])
        loss.backward()
        opt.step()
        return global_mean_loss(loss)

    return step


def _bench(args: argparse.Namespace) -> dict:
    if args.pair == "ddp":
        return time_against_native(
            args, build_model, sgd, ddp_compiled, dp=args.world, zero=0, compile=True
        )
    return time_against_native(
        args,
        build_model,
        sgd,
        fsdp2_compiled,
        dp=args.world,
        zero=3,
        precision="bf16-params",
        compile=True,
    )


def main() -> None:
    parser = comparison_options(__doc__, steps=30, rounds=3, batch=8, seq=64)
    parser.add_argument("--pair", choices=sorted(LOSS_RTOL), default="ddp")
    args = parser.parse_args()
    run_comparison(
        _bench,
        args,
        f"compiled_vs_{args.pair}",
        target_ratio=1.05,
        loss_rtol=LOSS_RTOL[args.pair],
    )


if __name__ == "__main__":
    main()
