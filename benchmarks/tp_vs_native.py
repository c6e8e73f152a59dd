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
import torch.nn.functional as F
from timing import compare, report
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import autopart
from autopart.testing import run_world

VOCAB = 2048


def build_model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return LlamaForCausalLM(config)


def loss_fn(output, target):
    return F.cross_entropy(output.logits.flatten(0, 1), target.flatten())


def native_tp(model, world: int):
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


def _bench(steps: int, rounds: int, batch: int, seq: int) -> dict:
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    target = torch.randint(0, VOCAB, (batch, seq), generator=g)

    pm = autopart.parallelize(
        build_model(),
        autopart.Mesh.local(),
        (ids,),
        loss_fn=loss_fn,
        optimizer=lambda p: torch.optim.SGD(p, lr=1e-3),
        tp=world,
    )
    native = native_tp(build_model(), world)
    native_opt = torch.optim.SGD(native.parameters(), lr=1e-3)

    def native_step() -> float:
        native_opt.zero_grad()
        loss = loss_fn(native(ids), target)
        loss.backward()
        native_opt.step()
        return loss.item()

    def autopart_step() -> float:
        return pm.train_step(ids, target).item()

    result = compare(autopart_step, native_step, steps, rounds)
    pm.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    per_rank = run_world(_bench, args.world, args.steps, args.rounds, args.batch, args.seq)
    print(
        report(
            "tp_vs_parallelize_module",
            per_rank,
            1.0,
            world=args.world,
            batch=args.batch,
            seq=args.seq,
        )
    )


if __name__ == "__main__":
    main()
