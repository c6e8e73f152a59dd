"""A GPU preset's shape model against GEMMs and fused attention measured on the GPU.

    python benchmarks/preset_vs_gpu.py measure --out shapes.json    (on a CUDA machine)
    python benchmarks/preset_vs_gpu.py compare shapes.json [--device h100-80g]

`measure` needs only PyTorch and a GPU: it times the forward and backward of each shape
below in bf16 (a linear layer's product, m×k by k×n, and `scaled_dot_product_attention`
over [B, H, S, E], not causal, as the shape model charges the scores in full; then the
same attention shapes causal, kind "causal_attention"), the median of `REPEATS`
CUDA-event timings after warm-up, and writes them with the GPU's name. `compare` prices
the same shapes with the preset's compute model (`cost_models.compute`,
`cost_models.gemm`: tiles and waves for GEMMs, query blocks by key length and head dim
for attention, the memory roofline and launch floor) and prints one JSON line per
shape, predicted over measured, then a summary of the GEMMs and full attention: the
median and largest relative error, how many shapes fall within ±15%, and the two
efficiencies (`matmul_efficiency`, `attention_efficiency`) refitted to these
measurements with the error they leave. `--profile-out` writes the refitted preset as a
device profile (`Mesh.cluster(path, ...)` reads it). Causal attention is summed up
apart, in a last line: each causal shape's measured time over the same shape's full
one, the shape model's price of the same (`gemm.causal_fraction`), and the preset's
error on the causal shapes. The last measurements on an H100 and an H200 are kept
beside this file (`data/h100_shapes.json`, `data/h200_shapes.json`; the H100's has no
causal rows), with `autopart calibrate`'s profile of each GPU
(`data/*_calibrated_profile.json`, which `--device` takes as a path).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from autopart.mesh import DeviceSpec

# (m, n, k): a linear layer's tokens m, output features n, input features k. Transformer
# shapes (GPT-3/Llama widths and MLPs at 4-16k tokens, their tp=8 shards, a 128k
# vocabulary head), tile-boundary pairs (one past a multiple of 128/256) and small ones.
GEMMS = [
    (4096, 4096, 4096),
    (8192, 4096, 4096),
    (16384, 4096, 4096),
    (8192, 12288, 4096),
    (8192, 4096, 12288),
    (8192, 14336, 4096),
    (8192, 4096, 14336),
    (8192, 11008, 4096),
    (8192, 1536, 12288),
    (8192, 12288, 1536),
    (8192, 6144, 8192),
    (8192, 8192, 8192),
    (4096, 16384, 16384),
    (8192, 2048, 16384),
    (8192, 128256, 4096),
    (4096, 4096, 4097),
    (4096, 4097, 4096),
    (4097, 4096, 4096),
    (4096, 4224, 4096),
    (4096, 4352, 4096),
    (2048, 2048, 2048),
    (1024, 1024, 1024),
    (512, 4096, 4096),
    (256, 1024, 1024),
]
# (B, H, S, E)
ATTENTION = [
    (1, 32, 2048, 128),
    (1, 32, 4096, 128),
    (2, 16, 2048, 128),
    (1, 64, 2048, 128),
    (1, 32, 8192, 128),
    (4, 32, 1024, 128),
    (8, 16, 512, 128),
    (1, 32, 2048, 64),
    (2, 48, 2048, 64),
]
CAUSAL = "causal_attention"
WARMUP, REPEATS = 5, 20
WITHIN = 0.15


def measure(out: Path) -> None:
    assert torch.cuda.is_available(), "measure runs on a CUDA machine"
    # Two seconds of large products first, so that the clocks have ramped up.
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    start = time.perf_counter()
    while time.perf_counter() - start < 2.0:
        a @ a
    torch.cuda.synchronize()
    rows = [
        {"kind": "gemm", "shape": list(shape), "seconds": _timed(_gemm_step(*shape))}
        for shape in GEMMS
    ]
    rows += [
        {"kind": kind, "shape": list(shape), "seconds": _timed(_attention_step(*shape, causal))}
        for kind, causal in (("attention", False), (CAUSAL, True))
        for shape in ATTENTION
    ]
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({"measured": len(rows), "gpu": result["gpu"]}))


def _gemm_step(m: int, n: int, k: int) -> Callable[[], None]:
    x, w, g = (_cuda(m, k), _cuda(n, k), _cuda(m, n, grad=False))
    return lambda: F.linear(x, w).backward(g)


def _attention_step(b: int, h: int, s: int, e: int, causal: bool) -> Callable[[], None]:
    q, k, v = (_cuda(b, h, s, e) for _ in range(3))
    g = _cuda(b, h, s, e, grad=False)
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(g)


def _cuda(*shape: int, grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=grad)


def _timed(step: Callable[[], None]) -> float:
    """Median seconds of one call, over samples of back-to-back calls lasting at least
    a millisecond (a small shape's single call is all launch jitter)."""
    for _ in range(WARMUP):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    torch.cuda.synchronize()
    calls = max(1, math.ceil(1.0 / start.elapsed_time(end)))  # elapsed_time is in ms
    times = []
    for _ in range(REPEATS):
        start.record()
        for _ in range(calls):
            step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    torch.cuda.empty_cache()
    return statistics.median(times)


def predicted_seconds(kind: str, shape: list[int], spec: DeviceSpec) -> float:
    """The preset's forward and backward of one shape: the operator captured on the
    meta device as autopart captures models, priced by the compute model in bf16."""
    import torch

    from autopart.capture import capture
    from autopart.cost_models.compute import ComputeModel
    from autopart.passes import analyze

    meta = {"device": "meta", "dtype": torch.bfloat16}
    if kind == "gemm":
        m, n, k = shape
        module = torch.nn.Linear(k, n, bias=False, **meta)
        inputs: tuple = (torch.empty(m, k, **meta),)
    else:
        module = Attention(causal=kind == CAUSAL)
        inputs = tuple(torch.empty(*shape, **meta) for _ in range(3))
    captured = capture(module, inputs)
    analyze(captured.gm, captured.context())
    model = ComputeModel(spec, "bf16-mixed")
    return model.nodes_cost(captured.gm, captured.dim_sizes).total


class Attention(torch.nn.Module):
    """scaled_dot_product_attention as a module, for capture."""

    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


def compare(measurements: Path, device: str, profile_out: Path | None) -> None:
    from autopart.mesh import device_spec

    spec = device_spec(device)
    data = json.loads(measurements.read_text())
    every = [
        {**row, "predicted": predicted_seconds(row["kind"], row["shape"], spec)}
        for row in data["rows"]
    ]
    for row in every:
        print(
            json.dumps(
                {
                    "benchmark": "preset_vs_gpu",
                    "kind": row["kind"],
                    "shape": row["shape"],
                    "measured_ms": round(row["seconds"] * 1e3, 4),
                    "predicted_ms": round(row["predicted"] * 1e3, 4),
                    "predicted_over_measured": round(row["predicted"] / row["seconds"], 3),
                }
            ),
            flush=True,
        )
    rows = [row for row in every if row["kind"] != CAUSAL]
    summary = {"benchmark": "preset_vs_gpu", "gpu": data["gpu"], "device": device}
    summary.update(_errors(rows, "preset"))
    # Refit: scaling a family's efficiency scales its compute-bound times inversely;
    # the median ratio is the robust fit of that one factor.
    for kind, field in (("gemm", "matmul_efficiency"), ("attention", "attention_efficiency")):
        ratios = [r["predicted"] / r["seconds"] for r in rows if r["kind"] == kind]
        summary[f"fitted_{field}"] = round(getattr(spec, field) * statistics.median(ratios), 3)
        summary[f"preset_{field}"] = getattr(spec, field)
    fitted = replace(
        spec,
        matmul_efficiency=summary["fitted_matmul_efficiency"],
        attention_efficiency=summary["fitted_attention_efficiency"],
    )
    refit = [{**r, "predicted": predicted_seconds(r["kind"], r["shape"], fitted)} for r in rows]
    summary.update(_errors(refit, "fitted"))
    print(json.dumps(summary))
    causal = [row for row in every if row["kind"] == CAUSAL]
    if causal:
        print(json.dumps(_causal_summary(causal, rows, device)))
    if profile_out is not None:  # a device profile that Mesh.cluster(path) reads
        profile_out.write_text(json.dumps(replace(fitted, name=f"{spec.name}-fitted").to_json()))


def _causal_summary(causal: list[dict], rows: list[dict], device: str) -> dict:
    """Causal attention against the same shapes' full attention, measured and priced."""
    full = {tuple(r["shape"]): r for r in rows if r["kind"] == "attention"}
    measured = [r["seconds"] / full[tuple(r["shape"])]["seconds"] for r in causal]
    priced = [r["predicted"] / full[tuple(r["shape"])]["predicted"] for r in causal]
    return {
        "benchmark": "preset_vs_gpu",
        "kind": CAUSAL,
        "device": device,
        "measured_causal_over_full": [round(x, 3) for x in measured],
        "predicted_causal_over_full": [round(x, 3) for x in priced],
        "median_causal_over_full": round(statistics.median(measured), 3),
        **_errors(causal, "preset"),
    }


def _errors(rows: list[dict], label: str) -> dict:
    errors = [abs(r["predicted"] / r["seconds"] - 1) for r in rows]
    return {
        f"{label}_median_abs_error": round(statistics.median(errors), 3),
        f"{label}_max_abs_error": round(max(errors), 3),
        f"{label}_within_15pct": sum(e <= WITHIN for e in errors),
        "shapes": len(rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("measure").add_argument("--out", type=Path, required=True)
    comparing = sub.add_parser("compare")
    comparing.add_argument("measurements", type=Path)
    comparing.add_argument("--device", default="h100-80g")
    comparing.add_argument("--profile-out", type=Path, help="write the refitted preset here")
    args = parser.parse_args()
    if args.command == "measure":
        measure(args.out)
    else:
        compare(args.measurements, args.device, args.profile_out)


if __name__ == "__main__":
    sys.exit(main())
