"""How long planning takes at scale, against a bare capture of the same model.

    python benchmarks/plan_speed.py [--cases llama3-8b,llama3-70b,gpt-1t]

One JSON line per case: capture (with the analysis passes), solve and plan seconds;
a bare `torch.export.export(model, (ids,), strict=False)` of the same meta model, timed
in the same run after the plan; and their ratio, against the target of 1.0 (planning
costs no more than capturing the model once). Each also in CPU seconds of this process:
on a shared host the wall times move with the load, and a phase that waited for a core
skews the wall ratio, which the CPU ratio does not. Nothing is allocated: the models
are built on the meta device.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from harness import (
    LLAMA3_8B,
    bare_export_s,
    captured_on_meta,
    gpt,
    llama,
    lm_loss_pins,
    print_json_line,
    timed,
    warm_up_export,
)
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


TARGET_RATIO = 1.0  # plan seconds over bare-export seconds
T = TypeVar("T")


def with_cpu(fn: Callable[[], T]) -> tuple[T, float]:
    """`fn()`'s result and the CPU seconds this process spent on it: on a shared host a
    phase that waits for a core loses wall time that the CPU time does not count."""
    start = time.process_time()
    result = fn()
    return result, time.process_time() - start


def run(name: str, case: Case) -> None:
    (c, capture_s), capture_cpu = with_cpu(
        lambda: captured_on_meta(case.build, case.batch, case.seq)
    )
    mesh = autopart.Mesh.cluster(case.device, nodes=case.nodes, per_node=8)
    pins = Pins.of(precision="bf16-mixed", **lm_loss_pins(c))
    (plan, solve_s), solve_cpu = with_cpu(lambda: timed(lambda: make_plan(c, mesh, pins)))
    export_s, export_cpu = with_cpu(lambda: bare_export_s(case.build, case.batch, case.seq))
    print_json_line(
        {
            "benchmark": "plan_speed",
            "case": name,
            "mesh": mesh.describe(),
            "capture_s": round(capture_s, 1),
            "solve_s": round(solve_s, 1),
            "total_s": round(capture_s + solve_s, 1),
            "export_s": round(export_s, 1),
            "plan_over_export": round((capture_s + solve_s) / export_s, 2),
            "cpu_s": {
                "capture": round(capture_cpu, 1),
                "solve": round(solve_cpu, 1),
                "export": round(export_cpu, 1),
            },
            "cpu_plan_over_export": round((capture_cpu + solve_cpu) / export_cpu, 2),
            "target_ratio": TARGET_RATIO,
            "limit_s": case.limit_s,
            "plan": f"{plan.degrees} zero={plan.zero} m={plan.microbatches}"
            f" schedule={plan.schedule} recompute={len(plan.recompute)}",
            "predicted_step_s": round(plan.predicted.step_time_s, 2),
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    warm_up_export()
    for name in parser.parse_args().cases.split(","):
        run(name, CASES[name])


if __name__ == "__main__":
    main()
