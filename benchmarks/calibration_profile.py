"""What `autopart calibrate --quick` measures on this machine, against plausible ranges.

    python benchmarks/calibration_profile.py

The measured figures depend on how busy the machine is, so the test suite checks only
that calibration measures each one; this script prints them, one JSON line, with the
range a healthy two-core CPU host gives and whether each figure falls in it: among them
each of a linear layer's three products per dtype (`<dtype>_<product>_flops`) and fused
causal attention's cost per query row of a head (`<dtype>_attention_<direction>_row_s`).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from harness import print_json_line, timed

from autopart.calibrate import QUICK_COPY_BYTES, QUICK_MESSAGES, QUICK_SIZES, calibrate

# figure -> (low, high): wide enough for any CPU this runs on, narrow enough to catch a
# unit error (seconds for microseconds, bytes for elements) or a broken measurement.
PLAUSIBLE = {
    "peak_flops_fp32": (1e8, 1e13),
    "memory_bandwidth": (1e8, 1e12),
    "kernel_launch_s": (0.0, 1e-2),
    "tanh_per_s": (1e6, 1e12),
    "optimizer_tensor_s": (0.0, 1e-2),
    "compute_scale": (0.2, 5.0),  # measured / modeled time of a reference layer
}
# Each of a linear layer's products per dtype (fp32, bf16): a 16-bit product on a CPU
# without 16-bit instructions runs below 1 GFLOP/s in some layouts.
PRODUCT_PLAUSIBLE = (1e7, 1e13)
# Fused attention's seconds per query row of a head, per dtype and direction.
ATTENTION_ROW_PLAUSIBLE = (0.0, 1e-3)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        spec, seconds = timed(
            lambda: calibrate(
                Path(tmp) / "profile.json",
                sizes=QUICK_SIZES,
                messages=QUICK_MESSAGES,
                copy_bytes=QUICK_COPY_BYTES,
            )
        )
    figures = {
        "peak_flops_fp32": spec.peak_flops["fp32"],
        "memory_bandwidth": spec.memory_bandwidth,
        "kernel_launch_s": spec.kernel_launch_s,
        "tanh_per_s": spec.function_rates.get("tanh", 0.0),
        "optimizer_tensor_s": spec.optimizer_tensor_s or 0.0,
        "compute_scale": spec.compute_scale,
    }
    ranges = dict(PLAUSIBLE)
    for dtype, fits in spec.matmul_products.items():
        for product, fit in fits.items():
            figures[f"{dtype}_{product}_flops"] = fit["peak"]
            ranges[f"{dtype}_{product}_flops"] = PRODUCT_PLAUSIBLE
    for dtype, masks in spec.attention_rates.items():
        for direction, fit in masks.get("causal", {}).items():
            figures[f"{dtype}_attention_{direction}_row_s"] = fit["row_s"]
            ranges[f"{dtype}_attention_{direction}_row_s"] = ATTENTION_ROW_PLAUSIBLE
    outside = [k for k, v in figures.items() if not ranges[k][0] <= v < ranges[k][1]]
    print_json_line(
        {
            "benchmark": "calibration_profile",
            "calibrate_s": round(seconds, 1),
            **{k: float(f"{v:.4g}") for k, v in figures.items()},
            "outside_plausible": outside,
        }
    )


if __name__ == "__main__":
    main()
