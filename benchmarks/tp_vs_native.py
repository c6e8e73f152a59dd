"""autopart tensor parallelism against torch's `parallelize_module`, same run.

    python benchmarks/tp_vs_native.py [--world 2] [--steps 20]

Both shard the same Llama-style model Megatron-style (q/k/v/gate/up column-parallel,
o/down row-parallel) over a tp group of Gloo CPU processes and train on the same batch.
Steps alternate between the two in rounds. Prints one JSON line with each median step
time and autopart / native.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from harness import (
    Step,
    comparison_options,
    llama,
    lm_loss,
    run_comparison,
    sgd,
    time_against_native,
)
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from transformers import LlamaForCausalLM

import autopart


def build_model() -> LlamaForCausalLM:
    return llama(
        hidden=512, intermediate=1536, layers=4, heads=8, kv_heads=8, vocab=2048, positions=128
    )


def native_tp(model: LlamaForCausalLM, world: int) -> nn.Module:
    mesh = init_device_mesh("cpu", (world,))
    plan = {}
    for i in range(len(model.model.layers)):
        prefix = f"model.layers.{i}"
        for name in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
        ):
            plan[f"{prefix}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"{prefix}.{name}"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def native_tp_baseline(
    pm: autopart.ParallelModule, ids: torch.Tensor, target: torch.Tensor
) -> Step:
    """A step of the model sharded by `parallelize_module` over every rank."""
    native = native_tp(build_model(), dist.get_world_size())
    native_opt = sgd(native.parameters())

    def native_step() -> float:
        native_opt.zero_grad()
        loss = lm_loss(native(ids), target)
        loss.backward()
        native_opt.step()
        return loss.item()

    return native_step


def _bench(args: argparse.Namespace) -> dict:
    return time_against_native(args, build_model, sgd, native_tp_baseline, tp=args.world)


def main() -> None:
    args = comparison_options(__doc__, steps=20, rounds=2, batch=4, seq=128).parse_args()
    run_comparison(_bench, args, "tp_vs_parallelize_module", target_ratio=1.0)


if __name__ == "__main__":
    main()
