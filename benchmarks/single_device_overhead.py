"""What autopart's program costs over the plain model on one device, same run.

    torchrun --standalone --nproc-per-node 1 benchmarks/single_device_overhead.py

On one device a plan is the identity, so any difference is the price of running the
captured graph instead of the module, and of the runtime around it. Uses the GPU under
NCCL when there is one, else the CPU over Gloo. Prints one JSON line with each median
step time and autopart / eager.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import compare, llama, median_fields, print_json_line, token_batch
from transformers import LlamaForCausalLM

import autopart


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    return llama(
        hidden=args.hidden,
        intermediate=int(args.hidden * 8 / 3) // 64 * 64,
        layers=args.layers,
        heads=args.hidden // 64,
        kv_heads=args.hidden // 128,
        vocab=args.vocab,
        positions=args.seq,
    )


def loss_fn(output, target):
    # Under mixed precision the logits come in bf16 or fp16; the loss is taken in fp32.
    return F.cross_entropy(output.logits.flatten(0, 1).float(), target.flatten())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    mesh = autopart.Mesh.local()
    device = torch.device("cuda") if mesh.backend == "nccl" else torch.device("cpu")
    ids, target = token_batch(args.batch, args.seq, args.vocab)

    pm = autopart.parallelize(
        build_model(args),
        mesh,
        (ids,),
        loss_fn=loss_fn,
        precision=args.precision,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
    )
    eager = build_model(args).to(device)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-4)
    dtype = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(args.precision)
    ids_d, target_d = ids.to(device), target.to(device)

    # Both steps end in .item(), which waits for the device, so a step's time is its work.
    def eager_step() -> float:
        eager_opt.zero_grad()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = loss_fn(eager(ids_d), target_d)
        loss.backward()
        eager_opt.step()
        return loss.item()

    def autopart_step() -> float:
        return pm.train_step(ids, target).item()

    medians = compare(autopart_step, eager_step, args.steps, rounds=3)
    losses_after = (autopart_step(), eager_step())
    print_json_line(
        {
            "benchmark": "single_device_overhead",
            "device": str(device),
            "backend": mesh.backend,
            "precision": args.precision,
            "layers": args.layers,
            "hidden": args.hidden,
            "batch": args.batch,
            "seq": args.seq,
            **median_fields(medians["autopart"], medians["native"], baseline="eager"),
            "losses_after": [round(x, 4) for x in losses_after],
        }
    )
    pm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
