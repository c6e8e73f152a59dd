"""Train a small Hugging Face Llama with autopart on local CPU processes over Gloo.

    torchrun --standalone --nproc-per-node 4 examples/train_llama.py

Every rank builds the same model (random weights from a config, nothing downloaded),
autopart plans and parallelizes it, rank 0 prints the plan, and after training rank 0
replays the same steps on one device and checks the losses agree.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import autopart

VOCAB, SEQ = 256, 32


def build_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return LlamaForCausalLM(config)


def batches(steps: int, batch: int):
    """A learnable stream: each sequence counts upwards from a random start (mod VOCAB)."""
    g = torch.Generator().manual_seed(1234)
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (batch, 1), generator=g)
        tokens = (start + torch.arange(SEQ + 1)) % VOCAB
        yield tokens[:, :-1], tokens[:, 1:]


def loss_fn(output, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.flatten(0, 1), target.flatten())


def optimizer(params):
    return torch.optim.AdamW(params, lr=3e-3)


def train_single_device(steps: int, batch: int) -> list[float]:
    model = build_model()
    opt = optimizer(model.parameters())
    losses = []
    for ids, target in batches(steps, batch):
        opt.zero_grad()
        loss = loss_fn(model(ids), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def check_against_one_device(what: str, losses: list[float], batch: int, rtol: float) -> int:
    """Print whether `losses` match the same steps on one device; the exit status."""
    reference = train_single_device(len(losses), batch)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    verdict = "match" if worst <= rtol else "DO NOT match"
    print(
        f"{what} vs one device: losses {verdict} (largest relative difference {worst:.2e}, "
        f"tolerance {rtol:.0e}); loss {losses[0]:.3f} -> {losses[-1]:.3f}",
        flush=True,
    )
    return 0 if worst <= rtol else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--rtol", type=float, default=1e-4)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    mesh = autopart.Mesh.local()
    rank = dist.get_rank()
    ids, _ = next(batches(1, args.batch))
    model = build_model()
    pm = autopart.parallelize(model, mesh, (ids,), loss_fn=loss_fn, optimizer=optimizer)
    if rank == 0:
        print(pm.plan, end="\n\n", flush=True)

    losses = []
    for step, (ids, target) in enumerate(batches(args.steps, args.batch)):
        losses.append(pm.train_step(ids, target).item())
        if rank == 0:
            print(f"step {step:3d}  loss {losses[-1]:.5f}", flush=True)

    status = 0
    if rank == 0:
        print()
        what = f"{mesh.world_size} processes"
        status = check_against_one_device(what, losses, args.batch, args.rtol)
    pm.close()
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
