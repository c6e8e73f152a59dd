"""autopart's data parallelism against torch DistributedDataParallel, same run.

    python benchmarks/dp_vs_ddp.py [--world 2] [--steps 30]

Both train the same Llama-style model on the same global batch over Gloo on local CPU
processes. Steps alternate between the two in rounds, so drift in machine load hits
both alike. Prints one JSON line: each median step time and autopart / DDP.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from timing import compare, report
from torch.nn.parallel import DistributedDataParallel

import autopart
from autopart.testing import run_world


def build_model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=2048,
        max_position_embeddings=64,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return LlamaForCausalLM(config)


def loss_fn(output, target):
    return F.cross_entropy(output.logits.flatten(0, 1), target.flatten())


def _bench(steps: int, rounds: int, batch: int, seq: int) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 2048, (batch, seq), generator=g)
    target = torch.randint(0, 2048, (batch, seq), generator=g)

    pm = autopart.parallelize(
        build_model(),
        autopart.Mesh.local(),
        (ids,),
        loss_fn=loss_fn,
        optimizer=lambda p: torch.optim.SGD(p, lr=1e-3),
        dp=world,
        zero=0,
    )
    ddp = DistributedDataParallel(build_model())
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    local = slice(rank * batch // world, (rank + 1) * batch // world)

    def ddp_step() -> float:
        ddp_opt.zero_grad()
        loss = loss_fn(ddp(ids[local]), target[local])
        loss.backward()
        ddp_opt.step()
        mean = loss.detach() / world  # the global loss, as autopart's step returns it
        dist.all_reduce(mean)
        return mean.item()

    def autopart_step() -> float:
        return pm.train_step(ids, target).item()

    result = compare(autopart_step, ddp_step, steps, rounds)
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
    print(report("dp_vs_ddp", per_rank, 1.05, world=args.world, batch=args.batch, seq=args.seq))


if __name__ == "__main__":
    main()
