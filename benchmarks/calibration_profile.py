"""What `autopart calibrate --quick` measures on this machine, against plausible ranges.

    python benchmarks/calibration_profile.py

The measured figures depend on how busy the machine is, so the test suite checks only
that calibration measures each one; this script prints them, one JSON line, with the
range a healthy two-core CPU host gives and whether each figure falls in it.
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
    outside = [k for k, v in figures.items() if not PLAUSIBLE[k][0] < v < PLAUSIBLE[k][1]]
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
