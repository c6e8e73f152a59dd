"""Resume training from a sharded checkpoint, under another plan, after a rank dies.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/resume.py

The first attempt trains with plain data parallelism and ZeRO-1, writing a checkpoint
(parameters and AdamW state, each rank its own pieces) after every step; after step
`--kill-at` its last rank kills itself, as an out-of-memory killer would. The others
stop with an error that names the lost rank, and torchrun relaunches the job. The second
attempt plans tensor parallelism instead (`tp=2`), loads the checkpoint into that plan,
and trains on to `--steps`. Rank 0 logs each step's loss (JSON lines, `--losses`) and at the
end compares the whole run, both attempts, with one device.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from train_llama import batches, build_model, check_against_one_device, loss_fn, optimizer

import autopart

# The plan of each attempt: the relaunch resumes under the second.
PLANS = [{"zero": 1}, {"tp": 2}]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--kill-at", type=int, default=3, help="the first attempt dies here")
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--checkpoint", default="resume-checkpoint")
    parser.add_argument("--losses", default="resume-losses.jsonl")
    parser.add_argument("--rtol", type=float, default=1e-4)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    pins = PLANS[min(attempt, len(PLANS) - 1)]

    mesh = autopart.Mesh.local()
    rank, world = dist.get_rank(), dist.get_world_size()
    ids, _ = next(batches(1, args.batch))
    pm = autopart.parallelize(
        build_model(seed=attempt), mesh, (ids,), loss_fn=loss_fn, optimizer=optimizer, **pins
    )
    if Path(args.checkpoint).is_dir():
        autopart.load_checkpoint(pm, args.checkpoint)
    if rank == 0:
        plan = pm.plan
        layout = f"dp={plan.dp} tp={plan.tp} pp={plan.pp} zero={plan.zero}"
        print(f"attempt {attempt}: {layout}, resuming after step {pm.steps}", flush=True)

    for step, (ids, target) in enumerate(batches(args.steps, args.batch), start=1):
        if step <= pm.steps:  # trained before the checkpoint
            continue
        loss = pm.train_step(ids, target).item()
        autopart.save_checkpoint(pm, args.checkpoint)
        if rank == 0:
            with open(args.losses, "a") as log:
                log.write(json.dumps({"step": step, "loss": loss, "attempt": attempt}) + "\n")
        if attempt == 0 and step == args.kill_at and rank == world - 1:
            os.kill(os.getpid(), signal.SIGKILL)

    status = 0
    if rank == 0:
        lines = Path(args.losses).read_text().splitlines()
        logged = {e["step"]: e["loss"] for e in map(json.loads, lines)}
        losses = [logged[s] for s in range(1, args.steps + 1)]
        what = f"{args.steps} steps over {attempt + 1} attempts"
        status = check_against_one_device(what, losses, args.batch, args.rtol)
    pm.close()
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
