"""Plan quality against published large-scale training configurations.

For each configuration (model shape, cluster, global batch, and the parallelism its
authors trained with), on the meta device:
  * the experts' plan, pinned: what the source publishes (tp, pp, dp, microbatch size,
    schedule, ZeRO stage: none for Megatron-LM's and MT-NLG's runs; no sequence
    parallelism, which these runs predate, but for Llama 3, which does not say), the
    rest (recomputation, stage cuts) left to autopart's inner model. It must be inside the
    search space: pinned, it gets a prediction;
  * the free plan: only the precision pinned.
Checks, per configuration: when the experts' plan fits, the free search finds a plan
(never "no plan fits"), and that plan is predicted no slower than the experts'.

Sources (shapes and parallelism as published; GPT-style models are built as GPT-2
shapes of the published width, depth, heads and vocabulary):
  [M] Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
      Using Megatron-LM", SC 2021, Table 1 (A100-80GB, fp16, sequence 2048), with the
      microbatch sizes and virtual stages of the authors' launch script for it
      (NVIDIA/Megatron-LM, examples/sc21/run_table_1.sh: 8 sequences for 18.4B; 2 and
      v = 2 for 145.6B; 1 and v = 2 for 310.1B; 1 and plain 1F1B for 1T).
  [N] Smith et al., "Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B",
      2022 (2240 A100-80GB: tp 8 × pp 35 × dp 8, batch 1920, microbatch size 1).
  [B] BigScience, "BLOOM: A 176B-Parameter Open-Access Multilingual Language Model",
      2022, and its training notes (384 A100-80GB: tp 4 × pp 12 × dp 8, batch 2048,
      microbatch size 2, bf16, ZeRO stage 1).
  [L] Llama Team, "The Llama 3 Herd of Models", 2024, Table 4 (8192 H100-80GB: tp 8 ×
      pp 16 × dp 64, sequence 8192, 32 sequences per data-parallel rank).

Also timed, per configuration: the free plan's capture and search against a bare
`torch.export` of the same meta model (`free_plan_over_export`, target `SEARCH_TARGET`).

One JSON line per configuration, then a summary line; exits 1 if a check fails.
Takes several minutes on 2 cores (each model is captured on the meta device).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from harness import (
    bare_export_s,
    captured_on_meta,
    gpt,
    llama,
    lm_loss_pins,
    megatron_pins,
    pinned_as_published,
    print_json_line,
    timed,
    warm_up_export,
)
from torch import nn

import autopart
from autopart.plan import PlanError
from autopart.solver import Pins, make_plan


@dataclass(frozen=True)
class Config:
    source: str
    build: Callable[[], nn.Module]
    device: str
    gpus: int
    batch: int  # sequences per step
    seq: int
    precision: str
    experts: dict[str, Any] = field(default_factory=dict)  # pins, but for microbatch size
    microbatch_size: int | None = None


CONFIGS = {
    "gpt-18.4b": Config(
        "M",
        gpt(6144, 40, 48),
        "a100-80g",
        256,
        1024,
        2048,
        "fp16-mixed",
        megatron_pins(8, 1, recompute=None),
        8,
    ),
    "gpt-145.6b": Config(
        "M",
        gpt(12288, 80, 96),
        "a100-80g",
        1536,
        2304,
        2048,
        "fp16-mixed",
        megatron_pins(8, 8, v=2, recompute=None),
        2,
    ),
    "gpt-310.1b": Config(
        "M",
        gpt(16384, 96, 128),
        "a100-80g",
        1920,
        2160,
        2048,
        "fp16-mixed",
        megatron_pins(8, 16, v=2, recompute=None),
        1,
    ),
    "gpt-1008b": Config(
        "M",
        gpt(25600, 128, 160),
        "a100-80g",
        3072,
        3072,
        2048,
        "fp16-mixed",
        megatron_pins(8, 64, recompute=None),
        1,
    ),
    "mt-nlg-530b": Config(
        "N",
        gpt(20480, 105, 128),
        "a100-80g",
        2240,
        1920,
        2048,
        "fp16-mixed",
        megatron_pins(8, 35, recompute=None),
        1,
    ),
    "bloom-176b": Config(
        "B",
        gpt(14336, 70, 112, vocab=250880),
        "a100-80g",
        384,
        2048,
        2048,
        "bf16-mixed",
        dict(tp=4, pp=12, zero=1, schedule="1f1b", sequence_parallel=False),
        2,
    ),
    "llama3-405b": Config(
        "L",
        lambda: llama(
            hidden=16384,
            intermediate=53248,
            layers=126,
            heads=128,
            kv_heads=8,
            vocab=128256,
            positions=8192,
        ),
        "h100-80g",
        8192,
        2048,
        8192,
        "bf16-mixed",
        dict(tp=8, pp=16),
    ),
}


# The free plan's capture and search over a bare torch.export of the same meta model, at
# most (printed per configuration as `free_plan_over_export`; not a check: times move with
# the host's load).
SEARCH_TARGET = 2.0


def run(name: str, config: Config) -> bool:
    c, capture_s = captured_on_meta(config.build, config.batch, config.seq)
    mesh = autopart.Mesh.cluster(config.device, nodes=config.gpus // 8, per_node=8)
    experts = pinned_as_published(
        config.experts, config.gpus, config.batch, config.microbatch_size, config.precision
    )
    record: dict[str, Any] = {"benchmark": "plan_quality", "case": name, "source": config.source}
    record["mesh"] = mesh.describe()
    record["capture_s"] = round(capture_s, 1)
    try:
        pinned = make_plan(c, mesh, Pins.of(**experts, **lm_loss_pins(c)))
        record["experts"] = _summary(pinned)
    except PlanError as e:
        pinned = None
        record["experts"] = {"pins": experts, "refused": str(e)[:300]}
    try:
        free, solve_s = timed(
            lambda: make_plan(c, mesh, Pins.of(precision=config.precision, **lm_loss_pins(c)))
        )
        record["free"] = _summary(free)
        record["solve_s"] = round(solve_s, 1)
        export_s = bare_export_s(config.build, config.batch, config.seq)
        record["export_s"] = round(export_s, 1)
        record["free_plan_over_export"] = round((capture_s + solve_s) / export_s, 2)
    except PlanError as e:
        free = None
        record["free"] = {"refused": str(e)[:300]}
    ok = True
    if pinned is not None and pinned.predicted is not None:
        ok = free is not None and free.predicted is not None
        if ok:
            assert free is not None and free.predicted is not None
            ratio = free.predicted.step_time_s / pinned.predicted.step_time_s
            record["free_over_experts"] = round(ratio, 4)
            # The chosen plan is the simplest within the solver's slack of the fastest it
            # found; the fastest is reported too, to tell a gap in the search (> 1) from
            # that rule.
            fastest = min([free.predicted.step_time_s, *(a.step_time_s for a in free.alternatives)])
            record["fastest_found_over_experts"] = round(fastest / pinned.predicted.step_time_s, 4)
            ok = ratio <= 1 + 1e-9
    record["ok"] = ok
    print_json_line(record)
    return ok


def _summary(plan: autopart.Plan) -> dict[str, Any]:
    assert plan.predicted is not None
    per_replica = plan.global_batch // plan.dp
    return {
        "plan": f"{plan.degrees} zero={plan.zero} schedule={plan.schedule}"
        f" v={plan.virtual_stages} microbatch_size={per_replica // plan.microbatches}"
        f" recompute={len(plan.recompute)}",
        "step_s": round(plan.predicted.step_time_s, 3),
        "memory_gib": round(plan.predicted.peak_memory_bytes / 2**30, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CONFIGS))
    names = parser.parse_args().cases.split(",")
    warm_up_export()
    results = {name: run(name, CONFIGS[name]) for name in names}
    sources = {CONFIGS[n].source for n in names}
    print_json_line(
        {
            "benchmark": "plan_quality",
            "configurations": len(names),
            "sources": len(sources),
            "passed": sum(results.values()),
            "search_target_over_export": SEARCH_TARGET,
        }
    )
    sys.exit(0 if all(results.values()) else 1)


if __name__ == "__main__":
    main()
