"""How the free search's cost grows with the mesh: Megatron-LM's 310.1B on 1920 A100s
and 1T on 3072, and plan_speed's 1T GPT, against Llama-3-70B on 1024 H100s.

    python benchmarks/search_scaling.py [--rounds 3]

Each case is captured on the meta device, then its free search (`make_plan`, the
capture not counted) timed in CPU seconds, in a fresh process: a search's caches are
its own, and a process that planned another model first would search faster. The cases
run in turn, round after round, so that the host's load hits all alike. One JSON line
per case: its CPU seconds per round, their median, and the median over Llama-3-70B's,
against the target (at most 1.0: a larger mesh's search costs no more than the 70B
case's).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import plan_quality
import plan_speed
from harness import captured_on_meta, lm_loss_pins, print_json_line

import autopart
from autopart.solver import Pins, make_plan

BASELINE = "speed:llama3-70b"
CASES = (BASELINE, "quality:gpt-310.1b", "quality:gpt-1008b", "speed:gpt-1t")
TARGET_RATIO = 1.0


def search_cpu_s(case: str) -> float:
    """The CPU seconds of `case`'s free search, in this process."""
    kind, name = case.split(":")
    if kind == "speed":
        speed = plan_speed.CASES[name]
        build, batch, seq = speed.build, speed.batch, speed.seq
        mesh = autopart.Mesh.cluster(speed.device, nodes=speed.nodes, per_node=8)
        precision = "bf16-mixed"
    else:
        quality = plan_quality.CONFIGS[name]
        build, batch, seq = quality.build, quality.batch, quality.seq
        mesh = autopart.Mesh.cluster(quality.device, nodes=quality.gpus // 8, per_node=8)
        precision = quality.precision
    captured, _ = captured_on_meta(build, batch, seq)
    pins = Pins.of(precision=precision, **lm_loss_pins(captured))
    start = time.process_time()
    make_plan(captured, mesh, pins)
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a fresh process's own case
    args = parser.parse_args()
    if args.one:
        print(search_cpu_s(args.one))
        return
    seconds: dict[str, list[float]] = {case: [] for case in CASES}
    for _ in range(args.rounds):
        for case in CASES:
            run = [sys.executable, __file__, "--one", case]
            out = subprocess.run(run, check=True, capture_output=True, text=True).stdout
            seconds[case].append(float(out.split()[-1]))
    baseline = statistics.median(seconds[BASELINE])
    for case, times in seconds.items():
        median = statistics.median(times)
        print_json_line(
            {
                "benchmark": "search_scaling",
                "case": case.split(":")[1],
                "search_cpu_s": [round(t, 2) for t in times],
                "median_s": round(median, 2),
                "over_llama3_70b": round(median / baseline, 2),
                "target_ratio": TARGET_RATIO,
            }
        )


if __name__ == "__main__":
    main()
