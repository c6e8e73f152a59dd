"""autopart's ZeRO-3 against FSDP2 (`torch.distributed.fsdp.fully_shard`), same run.

    python benchmarks/zero3_vs_fsdp.py [--world 2] [--steps 30]

Both shard the same Llama-style model over every rank and train it with AdamW on the
same global batch, over Gloo on local CPU processes. FSDP2 gets the usual recipe: each
decoder layer sharded on its own, then the root (embedding, final norm and head), which
groups parameters as autopart's ZeRO-3 buckets do. Steps alternate between the two in
rounds, so drift in machine load hits both alike. Prints one JSON line: each median
step time and autopart / FSDP2.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from dp_vs_ddp import build_model, loss_fn
from timing import compare, report
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import autopart
from autopart.testing import run_world

VOCAB = 2048


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-4)


def _bench(steps: int, rounds: int, batch: int, seq: int) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    target = torch.randint(0, VOCAB, (batch, seq), generator=g)

    pm = autopart.parallelize(
        build_model(),
        autopart.Mesh.local(),
        (ids,),
        loss_fn=loss_fn,
        optimizer=_optimizer,
        dp=world,
        zero=3,
    )
    fsdp = build_model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in fsdp.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    fsdp_opt = _optimizer(fsdp.parameters())
    local = slice(rank * batch // world, (rank + 1) * batch // world)

    def fsdp_step() -> float:
        loss = loss_fn(fsdp(ids[local]), target[local])
        loss.backward()
        fsdp_opt.step()
        fsdp_opt.zero_grad()
        mean = loss.detach() / world
        dist.all_reduce(mean)
        return mean.item()

    def autopart_step() -> float:
        return pm.train_step(ids, target).item()

    result = compare(autopart_step, fsdp_step, steps, rounds)
    pm.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()
    per_rank = run_world(_bench, args.world, args.steps, args.rounds, args.batch, args.seq)
    print(
        report("zero3_vs_fsdp2", per_rank, 1.05, world=args.world, batch=args.batch, seq=args.seq)
    )


if __name__ == "__main__":
    main()
