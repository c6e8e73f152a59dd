"""Data-parallel training through torch.compile, with an unchanged training loop.

    torchrun --standalone --nproc-per-node 2 examples/compile_backend.py

`torch.compile(model, backend="autopart")` captures the model with dynamo; autopart
analyzes each graph and, in a world of several processes, averages the gradients over
it as DistributedDataParallel does, overlapped with backward. The loop is plain
PyTorch: `loss.backward(); optimizer.step()`. Each rank trains on its own slice of the
global batch; rank 0 then replays the same steps on one device and compares the losses.
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
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    autopart.Mesh.local()  # joins the torchrun world (Gloo on CPU)
    rank, world = dist.get_rank(), dist.get_world_size()

    model = build_model()
    compiled = torch.compile(model, backend="autopart")
    opt = optimizer(model.parameters())
    losses = []
    for ids, target in batches(args.steps, args.batch):
        share = args.batch // world  # this rank's slice of the global batch
        mine = slice(rank * share, (rank + 1) * share)
        opt.zero_grad()
        loss = loss_fn(compiled(ids[mine]), target[mine])
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)

    status = 0
    if rank == 0:
        what = f"torch.compile(backend='autopart') on {world} processes"
        status = check_against_one_device(what, losses, args.batch, args.rtol)
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
