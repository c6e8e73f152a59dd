"""Calibration writes a device profile that Mesh accepts, in one process and on a Gloo
world; the fitted matmul curve recovers a known one."""

from __future__ import annotations

import math

import pytest

from autopart.calibrate import COLLECTIVE_OPS, QUICK_MESSAGES, calibrate, fit_matmul_curve
from autopart.cli import main
from autopart.cost_models.comm import CommModel
from autopart.cost_models.work import FUNCTIONS
from autopart.mesh import Mesh, device_spec
from autopart.testing import run_world


@pytest.mark.slow  # kept out of the quick suite's 10 minutes; CI runs it
def test_quick_calibration_in_one_process_writes_a_loadable_profile(tmp_path, capsys):
    path = tmp_path / "profile.json"
    assert main(["calibrate", "--out", str(path), "--quick", "--name", "this-cpu"]) == 0
    spec = device_spec(path)
    assert spec.name == "this-cpu"
    # Every figure is measured (positive, finite); their sizes depend on how busy the
    # machine is, so benchmarks/calibration_profile.py reports them, not this test.
    measured = [
        spec.peak_flops["fp32"],
        spec.memory_bandwidth,
        spec.kernel_launch_s,
        spec.function_rates["tanh"],
        spec.optimizer_tensor_s,
        spec.compute_scale,
    ]
    assert all(x is not None and 0 < x < math.inf for x in measured), measured
    assert spec.matmul_efficiency == 1.0
    assert spec.collectives == {}  # a world of one has no collectives to measure
    assert set(spec.function_rates) <= set(FUNCTIONS.values())
    assert Mesh.cluster(path, nodes=1, per_node=2).device == spec
    assert "#" in capsys.readouterr().err  # the progress bar


def _calibrate_world(path: str) -> tuple[dict, dict]:
    spec = calibrate(path, sizes=(64,), messages=QUICK_MESSAGES, copy_bytes=1 << 20, repeats=2)
    return spec.collectives, spec.zero3_bucket


@pytest.mark.slow  # a world of timed collectives, kept out of the quick suite's 10 minutes
def test_calibration_on_a_gloo_world_fits_every_collective(tmp_path):
    path = tmp_path / "profile.json"
    per_rank = run_world(_calibrate_world, 2, str(path))
    assert per_rank[0] == per_rank[1]  # the ranks' mean, the same on every rank
    collectives, zero3_bucket = per_rank[0]
    assert set(collectives) == set(COLLECTIVE_OPS)  # Gloo runs every one
    for fit in collectives.values():
        assert fit["alpha"] >= 0 and fit["beta"] > 0
    spec = device_spec(path)
    assert spec.collectives == collectives
    # A ZeRO-3 bucket's collectives, measured as ZeRO-3 runs them (a CPU's profile).
    assert zero3_bucket["alpha"] >= 0 and zero3_bucket["beta"] > 0
    assert spec.zero3_bucket == zero3_bucket
    comm = CommModel(Mesh.cluster(spec, nodes=1, per_node=2))
    assert comm.algorithms("all_reduce", 1 << 20, 2).keys() == {"measured"}
    # A pipeline's transfer is priced from the measured send/recv, not the links.
    p2p = collectives["send_recv"]
    assert comm.send_time(1 << 20, 0, 1) == pytest.approx(p2p["alpha"] + p2p["beta"] * (1 << 20))


def test_matmul_curve_fit_recovers_peak_and_half_dim():
    # The compute model's curve: t(n) = launch + 2n³ / (peak · n / (n + n½)).
    peak, half, launch = 2e12, 96.0, 5e-6
    seconds = {n: launch + 2 * n**3 / (peak * n / (n + half)) for n in (16, 64, 256, 1024)}
    fitted_peak, fitted_half = fit_matmul_curve(seconds, launch)
    assert fitted_peak == pytest.approx(peak)
    assert fitted_half == pytest.approx(half)


def test_matmul_curve_fit_keeps_the_best_rate_when_it_would_extrapolate():
    # Still far from saturation at the largest size: the two-parameter fit would put the
    # peak far above anything measured.
    peak, half, launch = 1e12, 4096.0, 1e-6
    seconds = {n: launch + 2 * n**2 * (n + half) / peak for n in (256, 512, 1024)}
    fitted_peak, fitted_half = fit_matmul_curve(seconds, launch)
    assert fitted_peak == pytest.approx(max(2 * n**3 / t for n, t in seconds.items()))
    assert fitted_half > 0


def test_matmul_curve_fit_with_only_overhead_is_the_best_rate():
    seconds = {64: 1e-3, 128: 1e-3}  # no longer for a bigger matmul: overhead, not math
    assert fit_matmul_curve(seconds, launch=1e-3) == (2 * 128**3 / 1e-3, 0.0)
