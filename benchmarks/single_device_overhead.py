"""What autopart's program costs over the plain model on one device, same run.

    torchrun --standalone --nproc-per-node 1 benchmarks/single_device_overhead.py

On one device a plan is the identity, so any difference is the price of running the
captured graph instead of the module, and of the runtime around it. Uses the GPU under
NCCL when there is one, else the CPU over Gloo. Prints one JSON line with each median
step time and autopart / eager.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from timing import median_step_times

import autopart


def build_model(layers: int, hidden: int, vocab: int, seq: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=int(hidden * 8 / 3) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 128,
        vocab_size=vocab,
        max_position_embeddings=seq,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return LlamaForCausalLM(config)


def loss_fn(output, target):
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
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    target = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    sizes = (args.layers, args.hidden, args.vocab, args.seq)

    pm = autopart.parallelize(
        build_model(*sizes),
        mesh,
        (ids,),
        loss_fn=loss_fn,
        precision=args.precision,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
    )
    eager = build_model(*sizes).to(device)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-4)
    dtype = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(args.precision)
    ids_d, target_d = ids.to(device), target.to(device)

    def eager_step():
        eager_opt.zero_grad()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = loss_fn(eager(ids_d), target_d)
        loss.backward()
        eager_opt.step()
        return loss

    def autopart_step():
        return pm.train_step(ids, target)

    def synced(step):
        def run():
            step().item()  # waits for the device

        return run

    for step in (autopart_step, eager_step):
        step()
        step()
    medians = median_step_times(
        {"autopart": synced(autopart_step), "eager": synced(eager_step)}, args.steps, 3
    )
    first = (pm.train_step(ids, target).item(), eager_step().item())
    print(
        json.dumps(
            {
                "benchmark": "single_device_overhead",
                "device": str(device),
                "backend": mesh.backend,
                "precision": args.precision,
                "layers": args.layers,
                "hidden": args.hidden,
                "batch": args.batch,
                "seq": args.seq,
                "autopart_median_s": round(medians["autopart"], 5),
                "eager_median_s": round(medians["eager"], 5),
                "ratio": round(medians["autopart"] / medians["eager"], 3),
                "losses_after": [round(x, 4) for x in first],
            }
        )
    )
    pm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
