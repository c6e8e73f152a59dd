"""Training with compressed gradients against training without, same run.

    python benchmarks/grad_compression.py [--world 2] [--steps 400]

A small Llama-style LM learns a synthetic language: each sequence counts up from a
random start by a random stride, modulo the vocabulary, with a fifth of its tokens
replaced at random, so the next token mostly follows from the two before it. It trains
on `world` local Gloo processes of plain data parallelism with AdamW, once per gradient
compression: none, bf16, PowerSGD at ranks 4 and 1. Every run sees the same batches
from the same weights.

Prints one JSON line per compression: its final loss (the mean of the last 10 steps),
that over the uncompressed run's, and the largest relative gap between the two loss
curves after the first 10 steps; then a summary line. The band this benchmark holds
compression to: a final loss within 10% of the uncompressed run's.
"""

from __future__ import annotations

import argparse

import torch
from harness import llama, lm_loss, print_json_line

import autopart
from autopart.testing import run_world

COMPRESSIONS = (None, "bf16", "powersgd:rank=4", "powersgd:rank=1")
VOCAB, SEQ, BATCH = 64, 32, 16
BAND = 0.10
NOISE = 0.2
SKIP = 10  # the first steps, where every run is still at the untrained loss


def build_model() -> torch.nn.Module:
    return llama(
        hidden=128, intermediate=256, layers=2, heads=4, kv_heads=4, vocab=VOCAB, positions=SEQ
    )


def counting_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences start + stride·i (mod VOCAB) with NOISE of the tokens replaced at
    random (so the loss settles well above zero, where ratios of losses mean
    something), the same on every rank."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (BATCH, 1), generator=g)
    tokens = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    noise = torch.rand(tokens.shape, generator=g) < NOISE
    tokens = torch.where(noise, torch.randint(0, VOCAB, tokens.shape, generator=g), tokens)
    return tokens[:, :-1], tokens[:, 1:]


def train(compression: str | None, world: int, steps: int) -> list[float]:
    ids, _ = counting_batch(0)
    pm = autopart.parallelize(
        build_model(),
        autopart.Mesh.local(),
        (ids,),
        loss_fn=lm_loss,
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
        dp=world,
        tp=1,
        pp=1,
        grad_compression=compression,
    )
    losses = [pm.train_step(*counting_batch(step)).item() for step in range(steps)]
    pm.close()
    return losses


def train_all(world: int, steps: int) -> dict[str | None, list[float]]:
    return {c: train(c, world, steps) for c in COMPRESSIONS}


def final(losses: list[float]) -> float:
    return sum(losses[-10:]) / len(losses[-10:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    curves = run_world(train_all, args.world, args.world, args.steps)[0]
    plain = curves[None]
    within = []
    for compression, losses in curves.items():
        ratio = final(losses) / final(plain)
        gap = max(abs(a - b) / b for a, b in zip(losses[SKIP:], plain[SKIP:]))
        within.append(abs(ratio - 1) <= BAND)
        print_json_line(
            {
                "benchmark": "grad_compression",
                "compression": compression or "none",
                "first_loss": round(losses[0], 4),
                "final_loss": round(final(losses), 4),
                "final_over_uncompressed": round(ratio, 4),
                "max_curve_gap": round(gap, 4),
            }
        )
    print_json_line(
        {
            "benchmark": "grad_compression",
            "world": args.world,
            "steps": args.steps,
            "band": BAND,
            "within_band": sum(within),
            "compressions": len(within),
        }
    )


if __name__ == "__main__":
    main()
