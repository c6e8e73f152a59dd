"""Timing training steps against each other in one run, for the side-by-side benchmarks."""

from __future__ import annotations

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
