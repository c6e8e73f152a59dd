"""Resume training from a sharded checkpoint, under another plan, after a rank dies.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/resume.py [--out DIR]

The first attempt trains with plain data parallelism and ZeRO-1, writing a checkpoint
(parameters and AdamW state, each rank its own pieces) after every step; after step
`--kill-at` its last rank kills itself, as an out-of-memory killer would. The others
stop with an error that names the lost rank, and torchrun relaunches the job. The second
attempt plans tensor parallelism instead (`tp=2`), loads the checkpoint into that plan,
and trains on to `--steps`. Rank 0 logs each step's loss (JSON lines) and at the end
compares the whole run, both attempts, with one device.

The checkpoint and the losses go to `--out` (DIR/checkpoint, DIR/losses.jsonl). By
default they go to a temporary directory named after torchrun's run id, which every
rank and both attempts agree on, and which is removed once the run matches one device.
A first attempt that finds a checkpoint there (an earlier run's, in the same `--out`)
says so and resumes from it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from train_llama import batches, build_model, check_against_one_device, loss_fn, optimizer

import autopart

# The plan of each attempt: the relaunch resumes under the second.
PLANS = [{"zero": 1}, {"tp": 2}]


def run_directory(out: str | None) -> Path:
    """`out`, or a directory under the system's temporary one that every rank and every
    attempt of this torchrun job names alike: torchrun gives them one run id (a new one
    per `--standalone` job), where a temporary name of each process's own would differ."""
    if out is not None:
        return Path(out)
    run = os.environ.get("TORCHELASTIC_RUN_ID") or f"pid{os.getpid()}"
    return Path(tempfile.gettempdir()) / f"autopart-resume-{run}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--kill-at", type=int, default=3, help="the first attempt dies here")
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--out", help="checkpoint and losses (default: a temporary directory)")
    parser.add_argument("--rtol", type=float, default=1e-4)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    pins = PLANS[min(attempt, len(PLANS) - 1)]
    out = run_directory(args.out)
    checkpoint, losses = out / "checkpoint", out / "losses.jsonl"

    mesh = autopart.Mesh.local()
    rank, world = dist.get_rank(), dist.get_world_size()
    ids, _ = next(batches(1, args.batch))
    pm = autopart.parallelize(
        build_model(seed=attempt), mesh, (ids,), loss_fn=loss_fn, optimizer=optimizer, **pins
    )
    found = checkpoint.is_dir()
    if found:
        autopart.load_checkpoint(pm, checkpoint)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        print(_starting(attempt, pm.plan, pm.steps, found, out), flush=True)

    for step, (ids, target) in enumerate(batches(args.steps, args.batch), start=1):
        if step <= pm.steps:  # trained before the checkpoint
            continue
        loss = pm.train_step(ids, target).item()
        autopart.save_checkpoint(pm, checkpoint)
        if rank == 0:
            with open(losses, "a") as log:
                log.write(json.dumps({"step": step, "loss": loss, "attempt": attempt}) + "\n")
        if attempt == 0 and step == args.kill_at and rank == world - 1:
            os.kill(os.getpid(), signal.SIGKILL)

    status = 0
    if rank == 0:
        logged = {e["step"]: e["loss"] for e in map(json.loads, losses.read_text().splitlines())}
        steps = [logged[s] for s in range(1, args.steps + 1)]
        what = f"{args.steps} steps over {attempt + 1} attempts"
        status = check_against_one_device(what, steps, args.batch, args.rtol)
    pm.close()
    dist.barrier()  # every rank is done with the checkpoint
    if rank == 0 and args.out is None and status == 0:
        shutil.rmtree(out, ignore_errors=True)
        print(f"removed {out}, the temporary directory of the checkpoint and losses")
    elif rank == 0:
        print(f"the checkpoint and losses are in {out}")
    dist.destroy_process_group()
    return status


def _starting(attempt: int, plan: autopart.Plan, steps: int, found: bool, out: Path) -> str:
    layout = f"dp={plan.dp} tp={plan.tp} pp={plan.pp} zero={plan.zero}"
    if not found:
        return f"attempt {attempt}: {layout}, starting afresh in {out}"
    if attempt == 0:  # the relaunch expects the first attempt's; this is an earlier run's
        return (
            f"attempt 0: {layout}, found an earlier run's checkpoint in {out}, after step "
            f"{steps}: resuming from it (another --out starts afresh)"
        )
    return f"attempt {attempt}: {layout}, resuming after step {steps}"


if __name__ == "__main__":
    sys.exit(main())
