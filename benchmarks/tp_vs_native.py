"""autopart tensor parallelism against torch's `parallelize_module`, same run.

    python benchmarks/tp_vs_native.py [--world 2] [--steps 20]

Both shard the same Llama-style model Megatron-style (q/k/v/gate/up column-parallel,
o/down row-parallel; autopart's plan pinned to that layout) over a tp group of Gloo CPU
processes and train on the same batch.
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
    token_batch,
)
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
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


COLUMNS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
)
ROWS = ("self_attn.o_proj", "mlp.down_proj")


def megatron_layers(model: LlamaForCausalLM) -> dict[str, str]:
    """Every block's linear layers, "column" or "row": the layout both sides run."""
    return {
        f"model.layers.{i}.{name}": kind
        for i in range(len(model.model.layers))
        for names, kind in ((COLUMNS, "column"), (ROWS, "row"))
        for name in names
    }


def native_tp(model: LlamaForCausalLM, world: int) -> nn.Module:
    mesh = init_device_mesh("cpu", (world,))
    styles = {"column": ColwiseParallel, "row": RowwiseParallel}
    plan = {path: styles[kind]() for path, kind in megatron_layers(model).items()}
    return parallelize_module(model, mesh, plan)


def megatron_plan(args: argparse.Namespace) -> autopart.Plan:
    """autopart's plan with the layout pinned to the native side's (the solver would
    choose its own on this CPU mesh, vocabulary-parallel embedding included)."""
    model = build_model()
    ids, _ = token_batch(args.batch, args.seq, model.config.vocab_size)
    plan = autopart.plan(model, autopart.Mesh.local(), (ids,), tp=args.world)
    dims = {"column": Shard(0), "row": Shard(1)}
    layers = megatron_layers(model)
    placements = {
        fqn: (Replicate(), dims[layers[fqn.removesuffix(".weight")]])
        if fqn.removesuffix(".weight") in layers
        else (Replicate(), Replicate())
        for fqn in plan.placements
    }
    return plan.with_changes(placements=placements)


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
    plan = megatron_plan(args)
    return time_against_native(args, build_model, sgd, native_tp_baseline, plan=plan)


def main() -> None:
    args = comparison_options(__doc__, steps=20, rounds=2, batch=4, seq=128).parse_args()
    run_comparison(_bench, args, "tp_vs_parallelize_module", target_ratio=1.0)


if __name__ == "__main__":
    main()
