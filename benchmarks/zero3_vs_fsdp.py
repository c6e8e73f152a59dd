"""autopart's ZeRO-3 against FSDP2 (`torch.distributed.fsdp.fully_shard`), same run.

    python benchmarks/zero3_vs_fsdp.py [--world 2] [--steps 30]

Both shard the same Llama-style model over every rank and train it with AdamW on the
same global batch, over Gloo on local CPU processes. FSDP2 gets the usual recipe: each
decoder layer sharded on its own, then the root (embedding, final norm and head), which
groups parameters as autopart's ZeRO-3 buckets do, with explicit forward and backward
prefetch of the next layer. Steps alternate between the two in rounds, so drift in
machine load hits both alike. Prints one JSON line: each median step time and
autopart / FSDP2, then each side's median seconds per phase and autopart / FSDP2 per
phase. The ratios are specific to CPU processes over Gloo, where collectives take the
cores compute uses; on GPUs with NCCL both overlap differently.

The phases are timed in the same steps as the medians (the timed ones, after the
warm-up), with `time.perf_counter()` at each phase's boundaries: four calls a step, too
few to move the step times. They are alike on both sides:

    forward_s    the model's forward to its logits, with the parameter all-gathers it
                 waits on. autopart: from the stage module's forward pre-hook to its
                 forward hook; FSDP2: the `model(ids)` call, its root unshard included.
    backward_s   the loss, backward and the gradient reduce-scatters waited for before
                 the optimizer runs. autopart: from the end of forward to the optimizer
                 step's pre-hook, so it also holds the wait for the last reductions and
                 the global loss's all-reduce (one scalar); FSDP2: the loss and
                 `loss.backward()`, whose reduce-scatters over Gloo are synchronous.
    optimizer_s  `optimizer.step()`: AdamW on this rank's shards. autopart: between the
                 step's pre- and post-hooks; FSDP2: the call itself.

Left out of every phase: zeroing the gradients, and autopart's input check and batch
split or FSDP2's global loss all-reduce; the phases thus add up to a little less than
the median step. Each phase's figure is its median over the timed steps on the slowest
rank, as a step is as slow as its slowest rank.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from dp_vs_ddp import build_model
from harness import (
    Step,
    comparison_options,
    global_mean_loss,
    lm_loss,
    run_comparison,
    this_ranks_rows,
    time_against_native,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import autopart

PHASES = ("forward_s", "backward_s", "optimizer_s")
SIDES = ("autopart", "fsdp2")
NOTE = (
    "CPU/Gloo-specific: local CPU processes over Gloo, where collectives take the cores"
    " compute uses; on GPUs with NCCL both overlap communication differently"
)


class PhaseClock:
    """One rank's seconds per step in each phase, from `time.perf_counter()` marks at
    the phases' boundaries (forward_start, forward_end, optimizer_start, optimizer_end)."""

    def __init__(self) -> None:
        self._marks: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []

    def mark(self, boundary: str) -> None:
        self._marks[boundary] = time.perf_counter()

    def end_step(self) -> None:
        m = self._marks
        self.steps.append(
            {
                "forward_s": m["forward_end"] - m["forward_start"],
                "backward_s": m["optimizer_start"] - m["forward_end"],
                "optimizer_s": m["optimizer_end"] - m["optimizer_start"],
            }
        )
        self._marks = {}

    def medians(self, timed: int) -> dict[str, float]:
        """Each phase's median over the last `timed` steps: those `compare` timed, not
        its warm-up."""
        steps = self.steps[-timed:]
        return {phase: statistics.median(s[phase] for s in steps) for phase in PHASES}


def clock_autopart(pm: autopart.ParallelModule, clock: PhaseClock) -> None:
    """Mark the phases inside `pm.train_step`, which runs them all in one call, by hooks:
    on its stage module's forward and on its optimizer's step."""
    # With several microbatches or pipeline stages, forwards and backwards interleave
    # and the end of one forward no longer divides the step in two.
    if pm.plan.pp != 1 or pm.plan.microbatches != 1 or pm.optimizer is None:
        raise SystemExit("zero3_vs_fsdp: the phase split needs one stage and one microbatch")
    stage = pm.stages[0]
    # Each hook returns None (mark's result), so neither changes the stage's output.
    stage.register_forward_pre_hook(lambda *_: clock.mark("forward_start"))
    stage.register_forward_hook(lambda *_: clock.mark("forward_end"))
    pm.optimizer.register_step_pre_hook(lambda *_: clock.mark("optimizer_start"))

    def after_step(*_: Any) -> None:
        clock.mark("optimizer_end")
        clock.end_step()

    pm.optimizer.register_step_post_hook(after_step)


def adamw(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


def fsdp_baseline(
    pm: autopart.ParallelModule, ids: torch.Tensor, target: torch.Tensor, clock: PhaseClock
) -> Step:
    """An FSDP2 step on this rank's share of the batch, each decoder layer and then the
    root sharded over every rank; `clock` marks its phases."""
    fsdp = build_model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    layers = list(fsdp.model.layers)
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    # Explicit prefetch, one layer ahead in each direction, as autopart's ZeRO-3 gathers.
    for i, layer in enumerate(layers):
        if i + 1 < len(layers):
            layer.set_modules_to_forward_prefetch([layers[i + 1]])
        if i > 0:
            layer.set_modules_to_backward_prefetch([layers[i - 1]])
    fsdp_opt = adamw(fsdp.parameters())
    local = this_ranks_rows(ids.shape[0])

    def fsdp_step() -> float:
        clock.mark("forward_start")
        output = fsdp(ids[local])
        # The loss counts as backward here, as on autopart's side, where it runs after
        # the stage module's forward hook.
        clock.mark("forward_end")
        loss = lm_loss(output, target[local])
        loss.backward()
        clock.mark("optimizer_start")
        fsdp_opt.step()
        clock.mark("optimizer_end")
        clock.end_step()
        fsdp_opt.zero_grad()
        return global_mean_loss(loss)

    return fsdp_step


def _bench(args: argparse.Namespace) -> dict:
    clocks = {side: PhaseClock() for side in SIDES}

    # time_against_native builds the baseline before either side's first step, so
    # autopart's hooks are in place from its first step on.
    def clocked_baseline(pm: autopart.ParallelModule, ids: torch.Tensor, target: torch.Tensor):
        clock_autopart(pm, clocks["autopart"])
        return fsdp_baseline(pm, ids, target, clocks["fsdp2"])

    result = time_against_native(args, build_model, adamw, clocked_baseline, dp=args.world, zero=3)
    timed = args.steps // args.rounds * args.rounds  # as many as `compare` times per side
    return result | {"phases": {side: clock.medians(timed) for side, clock in clocks.items()}}


def phase_fields(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON fields of the phases: each side's median per phase on its slowest rank,
    autopart / FSDP2 per phase, and the note that all of it is CPU/Gloo-specific."""
    phases = {
        side: {p: max(r["phases"][side][p] for r in per_rank) for p in PHASES} for side in SIDES
    }
    return {
        "phases": {
            side: {p: round(s, 5) for p, s in times.items()} for side, times in phases.items()
        },
        "phase_ratios": {
            p.removesuffix("_s"): round(phases["autopart"][p] / phases["fsdp2"][p], 3)
            for p in PHASES
        },
        "note": NOTE,
    }


def main() -> None:
    args = comparison_options(__doc__, steps=30, rounds=3, batch=8, seq=64).parse_args()
    run_comparison(_bench, args, "zero3_vs_fsdp2", target_ratio=1.05, extra_fields=phase_fields)


if __name__ == "__main__":
    main()
