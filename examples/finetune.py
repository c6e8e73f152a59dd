"""Fine-tune a small Hugging Face GPT-2 with an ordinary training loop, under autopart.

    torchrun --standalone --nproc-per-node 2 examples/finetune.py --out finetune-run

The loop is the one a DDP user writes: a DataLoader with a DistributedSampler (each
data-parallel rank passes its own share, `batch="per_rank"`), AdamW with a warm-up
cosine schedule, clipping at norm 1.0, gradient accumulation (`microbatches=2`: the
rank's share runs as two microbatches whose gradients sum into one step), validation
in eval mode every few steps, and a checkpoint. Halfway through, the job saves, builds
the model again under another plan (tensor parallelism instead of data parallelism),
loads the checkpoint with the scheduler, and trains on.

Rank 0 then runs the same loop on one device: the validation losses before training
(eval mode: dropout off) must agree, and with `--dropout 0` every training loss,
validation loss and learning rate must agree too (with dropout on, each rank draws its
own masks, as under DDP, so training losses differ from one device's by design).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

import autopart

VOCAB, SEQ = 128, 32
PLANS = ({"dp": 2, "zero": 1, "microbatches": 2}, {"tp": 2, "microbatches": 2})


def build_model(dropout: float) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        use_cache=False,  # Hugging Face models train under autopart without a KV cache
    )
    return GPT2LMHeadModel(config)


def token_dataset(sequences: int, seed: int) -> TensorDataset:
    """Sequences from a fixed random bigram table: structure a model can learn."""
    g = torch.Generator().manual_seed(1234)
    table = torch.randint(0, VOCAB, (VOCAB, 4), generator=g)  # 4 likely successors each
    g.manual_seed(seed)
    tokens = torch.empty(sequences, SEQ + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, VOCAB, (sequences,), generator=g)
    for t in range(SEQ):
        choice = torch.randint(0, 4, (sequences,), generator=g)
        tokens[:, t + 1] = table[tokens[:, t], choice]
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def loss_fn(output, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.flatten(0, 1), target.flatten())


def warmup_cosine(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    return factor


def loader(data: TensorDataset, batch: int, shares: int, share: int, shuffle: bool):
    """This rank's share of each global batch of `batch` sequences."""
    sampler = DistributedSampler(data, num_replicas=shares, rank=share, shuffle=shuffle, seed=0)
    return DataLoader(data, batch_size=batch // shares, sampler=sampler)


def train(args: argparse.Namespace, out: Path) -> dict:
    """The distributed run, on every rank: training losses, validation losses and
    learning rates, by step."""
    train_set, val_set = token_dataset(256, seed=1), token_dataset(32, seed=2)
    example = train_set.tensors[0][: args.batch]
    log: dict = {"loss": [], "val": [], "lr": [], "grad_norm": []}
    checkpoint = out / "checkpoint"
    for attempt, pins in enumerate(PLANS):  # the second resumes under another plan
        pm = autopart.parallelize(
            build_model(args.dropout),
            autopart.Mesh.local(),
            (example,),
            loss_fn=loss_fn,
            optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01),
            batch="per_rank",
            max_grad_norm=1.0,
            **pins,
        )
        assert pm.optimizer is not None
        schedule = warmup_cosine(2, args.steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(pm.optimizer, schedule)
        if attempt:
            autopart.load_checkpoint(pm, checkpoint, scheduler=scheduler)
        if dist.get_rank() == 0:
            print(f"plan {attempt}, from step {pm.steps}:\n{pm.plan}", flush=True)
        shares, share = pm.data_parallel_size, pm.data_parallel_rank
        batches = iter(loader(train_set, args.batch, shares, share, shuffle=True))
        for _ in range(pm.steps):  # what the checkpoint trained on already
            next(batches)
        last = args.steps // 2 if attempt == 0 else args.steps
        if pm.steps == 0:
            log["val"].append(validate(pm, loader(val_set, args.batch, shares, share, False)))
        while pm.steps < last:
            ids, target = next(batches)
            log["lr"].append(scheduler.get_last_lr()[0])
            log["loss"].append(pm.train_step(ids, target).item())
            log["grad_norm"].append(pm.grad_norm)
            scheduler.step()
            if pm.steps % args.validate_every == 0:
                log["val"].append(validate(pm, loader(val_set, args.batch, shares, share, False)))
        if attempt == 0:
            autopart.save_checkpoint(pm, checkpoint, scheduler=scheduler)
        pm.close()
    return log


@torch.no_grad()
def validate(pm: autopart.ParallelModule, batches: DataLoader) -> float:
    pm.eval()
    losses = [pm.evaluate(ids, target).item() for ids, target in batches]
    pm.train()
    return sum(losses) / len(losses)


def one_device(args: argparse.Namespace) -> dict:
    """The same loop on one device, with plain PyTorch."""
    model = build_model(args.dropout)
    train_set, val_set = token_dataset(256, seed=1), token_dataset(32, seed=2)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(2, args.steps))
    log: dict = {"loss": [], "val": [], "lr": [], "grad_norm": []}

    @torch.no_grad()
    def validate_here() -> float:
        model.eval()
        batches = loader(val_set, args.batch, 1, 0, shuffle=False)
        losses = [loss_fn(model(ids), target).item() for ids, target in batches]
        model.train()
        return sum(losses) / len(losses)

    log["val"].append(validate_here())
    batches = iter(loader(train_set, args.batch, 1, 0, shuffle=True))
    for step in range(1, args.steps + 1):
        ids, target = next(batches)
        log["lr"].append(scheduler.get_last_lr()[0])
        opt.zero_grad()
        loss = loss_fn(model(ids), target)
        loss.backward()
        log["grad_norm"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        opt.step()
        scheduler.step()
        log["loss"].append(loss.item())
        if step % args.validate_every == 0:
            log["val"].append(validate_here())
    return log


def compare(run: dict, reference: dict, dropout: float, rtol: float) -> bool:
    """Print how the run compares with one device; whether it agrees."""
    keys = ["val"] if dropout else ["loss", "val", "lr", "grad_norm"]
    pairs = [(k, a, b) for k in keys for a, b in zip(run[k], reference[k], strict=True)]
    if dropout:
        pairs = pairs[:1]  # before any training step: eval mode, the same weights
    worst = max(abs(a - b) / abs(b) for _, a, b in pairs)
    what = "the first validation loss" if dropout else "losses, validation losses, lrs, norms"
    verdict = "agree" if worst <= rtol else "DO NOT agree"
    print(f"{what} against one device: {verdict} (largest relative difference {worst:.1e})")
    print(f"training loss {run['loss'][0]:.3f} -> {run['loss'][-1]:.3f}; validation {run['val']}")
    return worst <= rtol


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--validate-every", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--rtol", type=float, default=1e-4)
    parser.add_argument("--out", help="where the checkpoint goes (default: a temporary folder)")
    return parser.parse_args(argv)


def job(args: argparse.Namespace) -> bool:
    """The run on every rank of the running world, and rank 0's comparison with one
    device: whether they agree (True on the other ranks)."""
    with _shared_folder(args.out) as out:
        run = train(args, out)
    if dist.get_rank() != 0:
        return True
    return compare(run, one_device(args), args.dropout, args.rtol)


@contextlib.contextmanager
def _shared_folder(path: str | None) -> Iterator[Path]:
    """`path`, or a temporary folder that rank 0 makes and removes: every rank writes
    its pieces of the checkpoint into the same one."""
    if path is not None:
        yield Path(path)
        return
    made = [tempfile.mkdtemp(prefix="finetune-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(made, src=0)
    try:
        yield Path(str(made[0]))
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(str(made[0]), ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        agree = job(args)
    finally:
        dist.destroy_process_group()
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
