"""The models people bring: tiny Hugging Face architectures (dense and MoE decoders,
encoders, encoder-decoders, vision, speech, image-text), `torch.nn.Transformer`, a
BatchNorm CNN and ordinary wrappers, each captured, planned and trained under several
pins on a local Gloo world of 2 CPU processes, against the same model trained on one
device.

    python benchmarks/model_zoo.py [--models llama,t5] [--pins dp2,cp2,ep2]

The models and cells are tests/zoo.py's: a cell (model, pins) trains 3 AdamW steps and
is one of "pass", "refused" (a clear error from capture or planning, its first line
recorded) or "fail". Every model has a cell under DP2, TP2, ZeRO-3 and PP2; under CP2
where it attends, under EP2 where it is a mixture of experts ("-" in the table where it
has none). Besides, each model is captured once here (`autopart.capture`'s
seconds: torch.export, non-strict) and planned at tp=2 without running: how many of its
parameter elements that plan keeps sharded over tp (an operator with no sharding rule,
such as a convolution, gathers its sharded weight and runs whole). Prints one JSON line
per cell, one per model, a table of models × pins, and a JSON line with the counts.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import sys
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # for `tests`

from harness import print_json_line  # noqa: E402
from torch.distributed.tensor import Shard  # noqa: E402

import autopart  # noqa: E402
from autopart.passes import analyze  # noqa: E402
from autopart.solver import Pins, make_plan  # noqa: E402
from tests.zoo import (  # noqa: E402
    MODELS,
    PINS,
    WORLD,
    Verdict,
    first_line,
    judge_model,
    pins_of,
)


def model_figures(model_name: str) -> dict[str, Any]:
    """The model's capture time and what a tp=2 plan shards: `tp_sharded` parameter
    elements of `params` (tied parameters counted once). The plan is the one
    `autopart.plan(model, mesh, inputs, tp=2)` makes, on a mesh like the zoo's, from the
    capture timed here rather than from a second one."""
    case = MODELS[model_name]
    model = case.model()
    inputs, _ = case.batch()
    params = sum(p.numel() for p in model.parameters())
    try:
        start = time.perf_counter()
        captured = autopart.capture(model, inputs)
        capture_s = time.perf_counter() - start
    except Exception as e:
        return {"params": params, "capture_error": first_line(e)}
    figures: dict[str, Any] = {"params": params, "capture_s": round(capture_s, 2)}
    try:
        analyze(captured.gm, captured.context())
        plan = make_plan(
            captured, autopart.Mesh.cluster("cpu", nodes=1, per_node=WORLD), Pins.of(tp=2)
        )
    except Exception as e:
        return {**figures, "tp_plan_error": first_line(e)}
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    sharded = sum(
        n for name, n in sizes.items() if isinstance(plan.placement(name, autopart.Axis.TP), Shard)
    )
    return {**figures, "tp_sharded": sharded, "tp_share": round(sharded / params, 3)}


def print_table(
    verdicts: dict[str, dict[str, Verdict]],
    figures: dict[str, dict[str, Any]],
    pin_names: list[str],
) -> None:
    """One row per model: each pin's status ("-" where the model has no such cell),
    the capture seconds and the tp=2 plan's sharded share of the parameters ("-" where
    capture or that plan failed)."""
    width = max(len(m) for m in verdicts) + 2
    header = "model".ljust(width) + "".join(p.ljust(9) for p in pin_names)
    print(header + "capture_s  tp_sharded", flush=True)
    for model_name, cells in verdicts.items():
        fig = figures[model_name]
        capture = f"{fig['capture_s']:.1f}" if "capture_s" in fig else "-"
        share = f"{fig['tp_share']:.0%}" if "tp_share" in fig else "-"
        row = "".join((cells[p]["status"] if p in cells else "-").ljust(9) for p in pin_names)
        print(model_name.ljust(width) + row + capture.ljust(11) + share, flush=True)


def subset(option: str, known: dict[str, Any], what: str) -> list[str]:
    names = option.split(",") if option else list(known)
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise SystemExit(f"unknown {what} {unknown}; known: {', '.join(known)}")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="", help="comma-separated, default all")
    parser.add_argument("--pins", default="", help="comma-separated, default all")
    args = parser.parse_args()
    model_names = subset(args.models, MODELS, "models")
    pin_names = subset(args.pins, PINS, "pins")
    verdicts, figures = {}, {}
    for model_name in model_names:
        figures[model_name] = model_figures(model_name)
        cells = pins_of(model_name, pin_names)
        verdicts[model_name] = judge_model(model_name, cells) if cells else {}
        for pin_name, cell in verdicts[model_name].items():
            record = {"model": model_name, "pins": pin_name, "pin_values": PINS[pin_name]}
            print_json_line({"benchmark": "model_zoo", **record, **cell})
        statuses = {p: c["status"] for p, c in verdicts[model_name].items()}
        family = MODELS[model_name].family
        print_json_line(
            {
                "benchmark": "model_zoo",
                "model": model_name,
                "family": family,
                **figures[model_name],
                "cells": statuses,
            }
        )
    print_table(verdicts, figures, pin_names)
    counts = collections.Counter(c["status"] for cells in verdicts.values() for c in cells.values())
    print_json_line(
        {
            "benchmark": "model_zoo",
            "models": len(model_names),
            "cases": sum(counts.values()),
            "pass": counts["pass"],
            "refused": counts["refused"],
            "fail": counts["fail"],
        }
    )


if __name__ == "__main__":
    main()
