"""Training through torch.compile, with an unchanged training loop.

    torchrun --standalone --nproc-per-node 2 examples/compile_backend.py [--tp 2] [--zero 3]

`torch.compile(model, backend="autopart")` captures the model with dynamo; autopart
analyzes each graph and, in a world of several processes, averages the gradients over
it as DistributedDataParallel does, overlapped with backward. With
`backend=autopart.backend(tp=..., zero=...)` it also lays each graph out for tensor
parallelism and shards optimizer state, gradients and parameters (ZeRO) by owner. The
loop is plain PyTorch: `loss.backward(); optimizer.step()`. Each data-parallel replica
trains on its own slice of the global batch (the ranks of a tp group on the same one);
rank 0 then replays the same steps on one device and compares the losses.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from train_llama import batches, build_model, check_against_one_device, loss_fn, optimizer

import autopart


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--rtol", type=float, default=1e-4)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    parser.add_argument("--zero", type=int, default=0, help="ZeRO stage (0-3)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    autopart.Mesh.local()  # joins the torchrun world (Gloo on CPU)
    rank, world = dist.get_rank(), dist.get_world_size()

    model = build_model()
    plain = args.tp == 1 and args.zero == 0
    backend = "autopart" if plain else autopart.backend(tp=args.tp, zero=args.zero)
    compiled = torch.compile(model, backend=backend)
    opt = optimizer(model.parameters())
    losses = []
    for ids, target in batches(args.steps, args.batch):
        replica, replicas = rank // args.tp, world // args.tp
        share = args.batch // replicas  # this replica's slice of the global batch
        mine = slice(replica * share, (replica + 1) * share)
        opt.zero_grad()
        loss = loss_fn(compiled(ids[mine]), target[mine])
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)

    status = 0
    if rank == 0:
        name = repr(backend)  # 'autopart', or autopart.backend(tp=..., zero=...)
        what = f"torch.compile(backend={name}) on {world} processes"
        status = check_against_one_device(what, losses, args.batch, args.rtol)
    dist.destroy_process_group()  # the backend releases its compiled graphs at exit
    return status


if __name__ == "__main__":
    sys.exit(main())
