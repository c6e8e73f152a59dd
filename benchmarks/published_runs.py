"""autopart's predicted step times against published, measured large-scale training runs.

Each configuration is a run its authors measured and published: the model's shape, the
cluster, the global batch, and the parallelism they trained with, pinned (tp, pp, dp,
microbatch size, schedule, ZeRO stage, full recomputation where they used it). What a
source does not publish is left to autopart's solver, as `plan_quality.py` does, and
said so below. Every configuration of one GPU type is priced with the same device
preset (`autopart.mesh.PRESETS`): nothing here is fitted to a configuration.

One JSON line per configuration: the predicted and the published step time, both as
model TFLOP/s per GPU counted with the source's own formula (`flops`), and the relative
error of the predicted throughput, predicted / published − 1 (the published step over
the predicted one, less 1: negative where autopart predicts a slower step). Then a
summary: how many lie within ±15%, the worst error, and Spearman's ρ between the error
and the parameter count (a trend with scale shows as |ρ| near 1).

Every source trained a 16-bit model (its weights and activations in fp16 or bf16, fp32
main weights held by the optimizer: Megatron-LM's mixed precision, which its
descendants keep). The models are built so, on the meta device, and priced at the
run's mixed precision: the cost models then charge no autocast casts and move 16-bit
activations (`cost_models/precision.py`), as those runs did. (autopart's own runtime
autocasts fp32 weights at every microbatch; the cost models price that for a model
built in fp32.) The GPT runs computed attention unfused, the scores written out, masked,
softmaxed and dropped out before the weighted sum (Megatron-LM before fused attention
kernels): the GPT models use Hugging Face's "eager" attention, whose operators the cost
models price one by one. Llama 3 ran fused attention (PyTorch's scaled-dot-product
kernel here).

Sources (figures as published; GPT models built as GPT-2 shapes of the published width,
depth, heads and vocabulary, sequence 2048, learned positions, 4h MLP):
  [N21] Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
        Using Megatron-LM", SC 2021, Table 1: GPT 1.7B-1T on DGX A100-80GB nodes (8 GPUs,
        8 HDR InfiniBand NICs each), fp16, sequence 2048, vocabulary 51,200, full
        recomputation; achieved TFLOP/s per GPU counted with their eq. (3),
        96·B·s·l·h²·(1 + s/6h + V/16lh) per iteration. The table gives tp, pp, GPUs
        and batch; the microbatch size and the schedule are the authors' launch
        settings for that table (NVIDIA/Megatron-LM, examples/sc21/run_table_1.sh:
        microbatches of 16, 16, 16, 8, 4, 2, 2, 1, 1, 1 sequences from 1.7B to 1T; the
        76B, 145B, 310B and 530B runs interleaved, 5, 5, 3 and 1 layers per virtual
        stage, i.e. v = 3, 2, 2 and 3).
  [S22] Smith et al., "Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B",
        2022, Section 3 (system performance table): 280, 350 and 420 DGX A100-80GB nodes,
        tp 8 × pp 35, batch 1920, sequence 2048, microbatch size 1, iteration time
        60.1 s, 50.2 s and 44.4 s (126, 121 and 113 TFLOP/s per GPU).
  [K22] Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
        Models", 2022, Table 3 (configurations) and the end-to-end iteration times of
        the "full recompute" baseline: 22B (8 GPUs, tp 8, batch 4, microbatch 4) 1.42 s,
        175B (64 GPUs, tp 8 × pp 8, batch 64) 18.13 s, 530B (280 GPUs, tp 8 × pp 35,
        batch 280) 49.05 s, 1T (512 GPUs, tp 8 × pp 64, batch 512) 94.42 s; A100-80GB,
        sequence 2048, microbatch size 1 with a pipeline, no data parallelism. The
        schedule is not in the table: 1F1B is assumed.
  [B22] BigScience, "BLOOM: A 176B-Parameter Open-Access Multilingual Language Model",
        2022, and its training write-up (Bekman, "The Technology Behind BLOOM
        Training", Hugging Face blog, 2022): 384 A100-80GB (48 nodes of 8), tp 4 ×
        pp 12 × dp 8, ZeRO stage 1, bf16, batch 2048, sequence 2048, microbatch size 2,
        full recomputation, about 150 TFLOP/s per GPU (Megatron-DeepSpeed's count, the
        same formula as [N21]). The vocabulary is 250,880; ALiBi replaces learned
        positions (a negligible difference in work). Jean Zay's nodes have 4 Omni-Path
        links of 100 Gb/s each (the paper's training hardware), not a NIC per GPU: the
        network of the mesh says so (the preset's A100 otherwise).
  [L24] Llama Team, "The Llama 3 Herd of Models", 2024, Table 4: Llama 3 405B on
        H100-80GB (nodes of 8), bf16, sequence 8192, tp 8 × pp 16, interleaved
        schedule: 8,192 GPUs at dp 64, 32 sequences per dp rank, 430 TFLOP/s per GPU;
        16,384 GPUs at dp 128, 16 sequences per dp rank, 400 TFLOP/s per GPU; FSDP
        sharding optimizer state and gradients, weights kept from forward to backward
        (section 3.3): ZeRO stage 2 is autopart's nearest. The microbatch size, virtual
        stages, recomputation and sequence parallelism are not published and are
        autopart's. Their FLOP
        count is not stated: the PaLM convention (Chowdhery et al., 2022, appendix B),
        6·N + 12·l·h·s per token, N the parameters but the input embedding's, is
        assumed.

Takes several minutes on 2 cores (each model is captured on the meta device).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from harness import (
    captured_on_meta,
    llama,
    lm_loss_pins,
    megatron_pins,
    pinned_as_published,
    print_json_line,
    spearman,
    timed,
)
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

import autopart
from autopart.mesh import PRESETS
from autopart.plan import PlanError
from autopart.policy import LOW_DTYPES
from autopart.solver import Pins, make_plan

WITHIN = 0.15  # the bar: 80% of configurations within ±15%, none beyond ±25%


@dataclass(frozen=True)
class Gpt:
    """A GPT of Megatron-LM's shape: FLOPs per iteration with full recomputation as
    [N21] eq. (3) counts them (4 forward passes of the layers, 3 of the LM head)."""

    hidden: int
    layers: int
    heads: int
    vocab: int = 51200

    def build(self) -> Callable[[], nn.Module]:
        """GPT-2 of this shape with its attention unfused (scores, softmax, dropout and
        the weighted sum as separate operators), as Megatron-LM ran it before fused
        attention kernels: Hugging Face's "eager" attention."""
        config = GPT2Config(
            n_layer=self.layers,
            n_embd=self.hidden,
            n_head=self.heads,
            n_positions=2048,
            vocab_size=self.vocab,
            use_cache=False,
            attn_implementation="eager",
        )
        return lambda: GPT2LMHeadModel(config)

    def flops(self, batch: int, seq: int) -> float:
        h, lay, v = self.hidden, self.layers, self.vocab
        return 96 * batch * seq * lay * h**2 * (1 + seq / (6 * h) + v / (16 * lay * h))


@dataclass(frozen=True)
class Llama:
    """A Llama of these sizes: model FLOPs per iteration in the PaLM convention,
    6·N + 12·l·h·s per token (N without the input embedding)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int

    def build(self) -> Callable[[], nn.Module]:
        sizes = dict(vars(self), positions=8192)
        return lambda: llama(**sizes)

    def flops(self, batch: int, seq: int) -> float:
        h, kv = self.hidden, self.hidden * self.kv_heads // self.heads
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * self.intermediate
        params = self.layers * per_layer + self.vocab * h  # the head, not the embedding
        return batch * seq * (6 * params + 12 * self.layers * h * seq)


@dataclass(frozen=True)
class Run:
    source: str
    shape: Gpt | Llama
    params_b: float  # the published size, billions of parameters
    device: str
    gpus: int
    batch: int  # sequences per step
    seq: int
    precision: str
    pins: dict[str, Any] = field(default_factory=dict)  # but dp and microbatches
    microbatch_size: int | None = None
    tflops: float | None = None  # published TFLOP/s per GPU ...
    step_s: float | None = None  # ... or published seconds per step
    # The cluster's NICs per node of 8 and Gb/s each where they are not the preset's
    # (DGX nodes: one per GPU, 200 Gb/s HDR with A100s, 400 Gb/s NDR with H100s).
    node_nics: tuple[int, float] | None = None

    def mesh(self) -> autopart.Mesh:
        device = PRESETS[self.device]
        if self.node_nics:
            count, gbits = self.node_nics
            device = replace(device, inter_node_bandwidth=count * gbits / 8 * 1e9 / 8)
        return autopart.Mesh.cluster(device, nodes=self.gpus // 8, per_node=8)

    def published_step_s(self) -> float:
        if self.step_s is not None:
            return self.step_s
        assert self.tflops is not None
        return self.shape.flops(self.batch, self.seq) / (self.gpus * self.tflops * 1e12)


FP16, BF16 = "fp16-mixed", "bf16-mixed"
A100, H100 = "a100-80g", "h100-80g"


def _n21(
    params: float,
    shape: Gpt,
    tp: int,
    pp: int,
    gpus: int,
    batch: int,
    mbs: int,
    v: int,
    tflops: float,
) -> Run:
    """A row of [N21] Table 1, with the microbatch size and virtual stages it ran."""
    return Run(
        "N21", shape, params, A100, gpus, batch, 2048, FP16, megatron_pins(tp, pp, v), mbs, tflops
    )


RUNS: dict[str, Run] = {
    "n21-gpt-1.7b": _n21(1.7, Gpt(2304, 24, 24), 1, 1, 32, 512, 16, 1, 137),
    "n21-gpt-3.6b": _n21(3.6, Gpt(3072, 30, 32), 2, 1, 64, 512, 16, 1, 138),
    "n21-gpt-7.5b": _n21(7.5, Gpt(4096, 36, 32), 4, 1, 128, 512, 16, 1, 142),
    "n21-gpt-18.4b": _n21(18.4, Gpt(6144, 40, 48), 8, 1, 256, 1024, 8, 1, 135),
    "n21-gpt-39.1b": _n21(39.1, Gpt(8192, 48, 64), 8, 2, 512, 1536, 4, 1, 138),
    "n21-gpt-76.1b": _n21(76.1, Gpt(10240, 60, 80), 8, 4, 1024, 1792, 2, 3, 140),
    "n21-gpt-145.6b": _n21(145.6, Gpt(12288, 80, 96), 8, 8, 1536, 2304, 2, 2, 148),
    "n21-gpt-310.1b": _n21(310.1, Gpt(16384, 96, 128), 8, 16, 1920, 2160, 1, 2, 155),
    "n21-gpt-529.6b": _n21(529.6, Gpt(20480, 105, 128), 8, 35, 2520, 2520, 1, 3, 163),
    "n21-gpt-1008b": _n21(1008.0, Gpt(25600, 128, 160), 8, 64, 3072, 3072, 1, 1, 163),
    **{
        f"s22-mt-nlg-530b-{nodes}-nodes": Run(
            "S22", Gpt(20480, 105, 128), 530, A100, nodes * 8, 1920, 2048, FP16,
            megatron_pins(8, 35), 1, step_s=seconds,
        )
        for nodes, seconds in ((280, 60.1), (350, 50.2), (420, 44.4))
    },
    "k22-gpt-22b": Run(
        "K22", Gpt(6144, 48, 64), 22, A100, 8, 4, 2048, FP16, megatron_pins(8, 1), 4, step_s=1.42
    ),
    "k22-gpt-175b": Run(
        "K22", Gpt(12288, 96, 96), 175, A100, 64, 64, 2048, FP16, megatron_pins(8, 8), 1,
        step_s=18.13,
    ),
    "k22-gpt-530b": Run(
        "K22", Gpt(20480, 105, 128), 530, A100, 280, 280, 2048, FP16, megatron_pins(8, 35), 1,
        step_s=49.05,
    ),
    "k22-gpt-1t": Run(
        "K22", Gpt(25600, 128, 160), 1000, A100, 512, 512, 2048, FP16, megatron_pins(8, 64), 1,
        step_s=94.42,
    ),
    "b22-bloom-176b": Run(
        "B22", Gpt(14336, 70, 112, vocab=250880), 176, A100, 384, 2048, 2048, BF16,
        dict(tp=4, pp=12, zero=1, schedule="1f1b", recompute=True, sequence_parallel=False),
        2, tflops=150,
        node_nics=(4, 100),
    ),
    **{
        f"l24-llama3-405b-{gpus}-gpus": Run(
            "L24", Llama(16384, 53248, 126, 128, 8, 128256), 405, H100, gpus,
            per_dp * gpus // 128, 8192, BF16,
            dict(tp=8, pp=16, schedule="interleaved-1f1b", zero=2), tflops=tflops,
        )
        for gpus, per_dp, tflops in ((8192, 32, 430), (16384, 16, 400))
    },
}  # fmt: skip


def predict(name: str, run: Run) -> dict[str, Any]:
    """`run` pinned and priced by autopart: one JSON record."""
    c, capture_s = _captured(run.shape, run.batch, run.seq, LOW_DTYPES[run.precision])
    mesh = run.mesh()
    pins = pinned_as_published(run.pins, run.gpus, run.batch, run.microbatch_size, run.precision)
    record: dict[str, Any] = {"benchmark": "published_runs", "case": name, "source": run.source}
    record |= {"params_b": run.params_b, "mesh": mesh.describe(), "capture_s": round(capture_s, 1)}
    flops = run.shape.flops(run.batch, run.seq)
    published = run.published_step_s()
    record["published"] = {"step_s": round(published, 3), "tflops": _tflops(flops, run, published)}
    try:
        plan, solve_s = timed(lambda: make_plan(c, mesh, Pins.of(**pins, **lm_loss_pins(c))))
    except PlanError as e:
        return record | {"refused": str(e)[:300], "error": None}
    p = plan.predicted
    assert p is not None
    record["plan"] = (
        f"{plan.degrees} zero={plan.zero} schedule={plan.schedule} v={plan.virtual_stages}"
        f" microbatches={plan.microbatches} recompute={len(plan.recompute)}"
    )
    record["solve_s"] = round(solve_s, 1)
    record["predicted"] = {
        "step_s": round(p.step_time_s, 3),
        "tflops": _tflops(flops, run, p.step_time_s),
        "compute_s": round(p.compute_s, 3),
        "exposed_comm_s": round(p.exposed_comm_s, 3),
        "bubble_s": round(p.bubble_s, 3),
        "memory_gib": round(p.peak_memory_bytes / 2**30, 1),
    }
    record["error"] = round(published / p.step_time_s - 1, 4)
    return record


@functools.cache
def _captured(shape: Gpt | Llama, batch: int, seq: int, dtype: torch.dtype) -> tuple[Any, float]:
    """The model built in the run's 16-bit dtype (module docstring), captured once per
    batch: the MT-NLG runs share theirs."""
    build = shape.build()
    return captured_on_meta(lambda: build().to(dtype), batch, seq)


def _tflops(flops: float, run: Run, step_s: float) -> float:
    return round(flops / run.gpus / step_s / 1e12, 1)


def summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """How many predictions lie within ±15%, the worst, and the trend with scale."""
    priced = [r for r in records if r["error"] is not None]
    errors = [r["error"] for r in priced]
    worst = max(priced, key=lambda r: abs(r["error"]), default=None)
    within = sum(abs(e) <= WITHIN for e in errors)
    rho = spearman(errors, [r["params_b"] for r in priced]) if len(priced) > 1 else 0.0
    return {
        "benchmark": "published_runs",
        "configurations": len(records),
        "sources": len({r["source"] for r in records}),
        "refused": len(records) - len(priced),
        "within_15pct": within,
        "fraction_within_15pct": round(within / len(records), 3) if records else 0.0,
        "worst": {"case": worst["case"], "error": worst["error"]} if worst else None,
        "beyond_25pct": sum(abs(e) > 0.25 for e in errors),
        "spearman_error_vs_params": round(rho, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(RUNS))
    names = parser.parse_args().cases.split(",")
    records = []
    for name in names:
        records.append(predict(name, RUNS[name]))
        print_json_line(records[-1])
    result = summary(records)
    print_json_line(result)
    ok = (
        result["refused"] == 0
        and result["fraction_within_15pct"] >= 0.8
        and result["beyond_25pct"] == 0
        and abs(result["spearman_error_vs_params"]) < 0.5
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
