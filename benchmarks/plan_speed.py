"""How long planning takes at scale: capture on the meta device, then the solver.

    python benchmarks/plan_speed.py [--cases llama3-8b,llama3-70b,gpt-1t]

One JSON line per case: capture (with the analysis passes), solve and total seconds,
against the case's end-to-end limit, and the plan chosen. Nothing is allocated: the
models are built on the meta device.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from dataclasses import dataclass

from harness import LLAMA3_8B, captured_on_meta, gpt, llama, lm_loss_pins, print_json_line, timed
from torch import nn

import autopart
from autopart.solver import Pins, make_plan


@dataclass(frozen=True)
class Case:
    build: Callable[[], nn.Module]
    batch: int
    seq: int
    device: str
    nodes: int
    limit_s: float


def _llama(hidden: int, ffn: int, layers: int, heads: int, kv: int) -> Callable[[], nn.Module]:
    return functools.partial(
        llama,
        hidden=hidden,
        intermediate=ffn,
        layers=layers,
        heads=heads,
        kv_heads=kv,
        vocab=128256,
        positions=8192,
    )


# Model shapes as published (Llama 3; the 1T GPT of Narayanan et al., 2021).
CASES = {
    "llama3-8b": Case(
        functools.partial(llama, **LLAMA3_8B, positions=8192), 512, 8192, "h100-80g", 8, 10.0
    ),
    "llama3-70b": Case(_llama(8192, 28672, 80, 64, 8), 1024, 8192, "h100-80g", 128, 20.0),
    "gpt-1t": Case(gpt(25600, 128, 160), 3072, 2048, "a100-80g", 384, 45.0),
}


def run(name: str, case: Case) -> None:
    c, capture_s = captured_on_meta(case.build, case.batch, case.seq)
    mesh = autopart.Mesh.cluster(case.device, nodes=case.nodes, per_node=8)
    plan, solve_s = timed(
        lambda: make_plan(c, mesh, Pins.of(precision="bf16-mixed", **lm_loss_pins(c)))
    )
    print_json_line(
        {
            "benchmark": "plan_speed",
            "case": name,
            "mesh": mesh.describe(),
            "capture_s": round(capture_s, 1),
            "solve_s": round(solve_s, 1),
            "total_s": round(capture_s + solve_s, 1),
            "limit_s": case.limit_s,
            "plan": f"{plan.degrees} zero={plan.zero} m={plan.microbatches}"
            f" schedule={plan.schedule} recompute={len(plan.recompute)}",
            "predicted_step_s": round(plan.predicted.step_time_s, 2),
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    for name in parser.parse_args().cases.split(","):
        run(name, CASES[name])


if __name__ == "__main__":
    main()
