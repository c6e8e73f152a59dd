"""Timing training steps against each other in one run, for the side-by-side benchmarks."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

import torch.distributed as dist


def median_step_times(
    steps: dict[str, Callable[[], object]], count: int, rounds: int
) -> dict[str, float]:
    """Median seconds per step of each of `steps`, over `count` steps each. The steps
    alternate in `rounds` runs of `count // rounds`, so drift in machine load hits all
    alike; each step starts after a barrier, so it times the whole world's step."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            for _ in range(count // rounds):
                dist.barrier()
                start = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def compare(
    autopart_step: Callable[[], float], native_step: Callable[[], float], count: int, rounds: int
) -> dict:
    """Warm both up (their first losses, from the same weights and batch, should agree),
    then time them against each other. Each step returns its loss as a float."""
    first = {"autopart": autopart_step(), "native": native_step()}
    autopart_step()
    native_step()
    medians = median_step_times({"autopart": autopart_step, "native": native_step}, count, rounds)
    return medians | {"first": first}


def report(
    benchmark: str, per_rank: list[dict], target: float, loss_rank: int = 0, **settings: object
) -> str:
    """The JSON line of a comparison: each median (a step is as slow as its slowest rank),
    autopart / native, the target, and both first losses as `loss_rank` saw them."""
    autopart_s = max(r["autopart"] for r in per_rank)
    native_s = max(r["native"] for r in per_rank)
    first = per_rank[loss_rank]["first"]
    return json.dumps(
        {
            "benchmark": benchmark,
            **settings,
            "autopart_median_s": round(autopart_s, 5),
            "native_median_s": round(native_s, 5),
            "ratio": round(autopart_s / native_s, 3),
            "target_ratio": target,
            "first_loss_autopart": round(first["autopart"], 6),
            "first_loss_native": round(first["native"], 6),
        }
    )
