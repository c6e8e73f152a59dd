"""Calibration writes a device profile that Mesh accepts, in one process and on a Gloo
world; the fitted matmul curve recovers a known one."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

import autopart.calibrate as cal
from autopart.calibrate import COLLECTIVE_OPS, QUICK_MESSAGES, calibrate, fit_matmul_curve
from autopart.cli import main
from autopart.cost_models.comm import CommModel
from autopart.cost_models.work import FUNCTIONS
from autopart.mesh import PRESETS, DeviceSpec, Mesh, device_spec
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


# ---------------------------------------------------------------------------------------
# Stability, plausibility and the host's load, with fake timers (no real timing asserted)


def _fake_samples(values: dict[str, list[float]]):
    """take(key): the next of `values[key]`, the last one repeated; and the counts taken."""
    taken = {key: 0 for key in values}

    def take(key: str) -> float:
        seq = values[key]
        taken[key] += 1
        return seq[min(taken[key], len(seq)) - 1]

    return take, taken


def test_a_steady_measurement_stops_at_the_rounds_asked_for():
    take, taken = _fake_samples({"steady": [1.0, 1.01, 0.99, 1.0, 1.02]})
    samples, unsettled = cal.sample_until_stable(take, ["steady"], repeats=5)
    assert taken == {"steady": 5} and unsettled == {}
    assert samples["steady"] == [1.0, 1.01, 0.99, 1.0, 1.02]


def test_a_noisy_measurement_is_sampled_again_until_it_settles():
    noisy = [1.0, 3.0, 1.0, 0.2, 1.0] + [1.0] * 20  # settles after its first five
    take, taken = _fake_samples({"noisy": noisy, "steady": [1.0]})
    samples, unsettled = cal.sample_until_stable(take, ["noisy", "steady"], repeats=5)
    assert unsettled == {}
    assert taken["steady"] == 5  # only the unstable one goes on
    assert taken["noisy"] == 5 + cal.STABLE_WINDOW - 1  # until its last window is steady
    assert cal.spread(samples["noisy"][-cal.STABLE_WINDOW :]) <= cal.STABLE_SPREAD


def test_a_measurement_that_never_settles_stops_at_the_cap_and_reports_its_spread():
    take, taken = _fake_samples({"loaded": [1.0, 2.0] * 50})
    samples, unsettled = cal.sample_until_stable(take, ["loaded"], repeats=4)
    assert taken["loaded"] == cal.MAX_ROUND_FACTOR * 4
    assert unsettled == {"loaded": pytest.approx(cal.spread(samples["loaded"][-5:]))}
    assert unsettled["loaded"] > cal.STABLE_SPREAD


def test_the_ranks_agree_on_whether_to_go_on():
    take, taken = _fake_samples({"a": [1.0], "b": [1.0]})

    # Another rank found "b" unstable: this one samples it again too, until the cap.
    def agree(flags: list[float]) -> list[bool]:  # ["a", "b"] at first, then ["b"]
        return [False, True] if len(flags) == 2 else [True]

    cal.sample_until_stable(take, ["a", "b"], 3, agree=agree)
    assert taken == {"a": 3, "b": cal.MAX_ROUND_FACTOR * 3}


def test_median_times_warns_of_an_unstable_measurement_by_name(monkeypatch):
    noisy = iter([1.0, 1.0] + [1e-3, 5e-3] * 50)  # warm-ups, then never settling
    fns = {128: lambda: next(noisy), 256: lambda: 2e-3}
    monkeypatch.setattr(cal, "_timed", lambda fn, device, calls: fn())
    cal.WARNINGS.clear()
    times = cal._median_times(fns, torch.device("cpu"), 5, "matmul fp32")
    assert set(times) == {128, 256}
    (warning,) = cal.WARNINGS
    assert warning.startswith("matmul fp32 128: not stable after 10 samples")
    assert "spread" in warning


def _sane(**changes) -> DeviceSpec:
    spec = replace(
        PRESETS["cpu"],
        function_rates={"exp": 2e9, "gelu": 1e9},
        optimizer_tensor_s=3e-5,
    )
    return replace(spec, **changes)


def test_plausible_figures_raise_no_warning():
    assert cal.implausible(_sane(), "cpu", threads=2) == []


def test_rates_outside_their_plausible_ranges_are_named():
    spec = _sane(
        function_rates={"gelu": 77.32e9, "silu": 0.09e9, "exp": 2e9},
        kernel_launch_s=1137e-6,
        peak_flops={"fp32": 1e7},
        memory_bandwidth=1e16,
        compute_scale=40.0,
    )
    found = cal.implausible(spec, "cpu", threads=2)
    named = [w.split(" ")[:2] for w in found]
    assert sorted(named) == sorted(
        [
            ["function", "gelu"],
            ["function", "silu"],
            ["operator", "floor"],
            ["matmul", "fp32"],
            ["memory", "bandwidth"],
            ["compute", "scale"],
        ]
    )
    assert all("plausible" in w for w in found)
    # More threads allow a faster function: gelu's 77 G/s is plausible on 8 of them.
    assert not any("gelu" in w for w in cal.implausible(spec, "cpu", threads=8))


def test_the_profile_records_the_hosts_load_and_the_warnings(tmp_path, monkeypatch):
    loads = iter([(3.5, 2.0, 1.0), (4.25, 2.5, 1.0)])
    monkeypatch.setattr(cal.os, "getloadavg", lambda: next(loads))
    monkeypatch.setattr(cal, "_operator_floor", lambda device, repeats: 1137e-6)

    def matmuls(sizes, dtype, product, device, repeats):
        return {1: 1e-6, **{n: 1e-6 + 2 * n**3 / 1e10 for n in sizes}}

    def functions(device, repeats):
        cal._warn("function gelu 16384: not stable after 10 samples, spread 80%")
        return {"gelu": 1e9}

    monkeypatch.setattr(cal, "_product_times", matmuls)
    monkeypatch.setattr(cal, "_attention_fits", lambda dtype, launch, device, repeats: {})
    monkeypatch.setattr(cal, "_copy_bandwidth", lambda nbytes, device, repeats: 1e10)
    monkeypatch.setattr(cal, "_function_rates", functions)
    monkeypatch.setattr(cal, "_optimizer_per_tensor", lambda device, repeats: 3e-5)
    monkeypatch.setattr(cal, "_compute_scale", lambda spec, device, repeats: 1.2)
    path = tmp_path / "profile.json"
    cal.calibrate(path, sizes=(64, 128), dtypes=("fp32",))
    spec = device_spec(path)
    record = spec.calibration
    assert (record["device_type"], record["world_size"]) == ("cpu", 1)
    assert record["load_before"] == [3.5, 2.0, 1.0]
    assert record["load_after"] == [4.25, 2.5, 1.0]
    warnings = record["warnings"]
    assert warnings[0].startswith("function gelu 16384: not stable")
    assert any(w.startswith("operator floor") for w in warnings)
    assert json.loads(path.read_text())["calibration"] == record


def test_a_cpu_collective_is_timed_between_pieces_of_compute():
    """On a CPU each collective is timed as a step issues it, a rendezvous after each
    piece of a layer's forward and of its backward, not back to back."""
    issued = []
    step = cal._blocking_stream(lambda: issued.append(len(issued)), torch.device("cpu"))
    step()
    assert len(issued) == 2 * cal.STREAM_PIECES


@pytest.mark.parametrize(("device", "in_stream"), [("cpu", True), ("cuda", False)])
def test_a_pipeline_transfer_is_timed_in_the_stream_on_a_cpu(monkeypatch, device, in_stream):
    """Send/recv on a CPU is timed between pieces of compute, as a stage sends after its
    microbatch: back to back, a receiver that sleeps in Gloo pays a scheduler's slice
    in some calibrations and not in others. On a GPU it stays back to back."""
    monkeypatch.setattr(cal, "_collective_call", lambda op, nbytes, device, world: lambda: None)
    monkeypatch.setattr(cal, "_blocking_stream", lambda collective, device: lambda: None)
    monkeypatch.setattr(cal, "_compute_burst", lambda device: lambda: None)
    how = []

    def added_times(runs, alone, device, repeats, per_run=1, rounds=cal.COLLECTIVE_ROUNDS):
        how.append("stream")
        return {n: 1e-3 + n * 1e-9 for n in runs}

    def median_times(fns, device, repeats, what=""):
        how.append("back to back")
        return {n: 1e-4 + n * 1e-9 for n in fns}

    monkeypatch.setattr(cal, "_added_times", added_times)
    monkeypatch.setattr(cal, "_median_times", median_times)
    messages = (1024, 1024**2)
    fitted = cal._collective_fit(
        "send_recv", messages, torch.device(device), 2, 5, cal.Progress(2, False)
    )
    assert how == (["stream"] if in_stream else ["back to back"])
    assert fitted is not None
    assert fitted["alpha"] == pytest.approx(1e-3 if in_stream else 1e-4)


def test_a_collective_that_adds_nothing_measurable_is_timed_back_to_back(monkeypatch):
    """On a busy host the time a collective adds between compute can fall to the floor;
    those messages take their time back to back, so that the fit does not price the
    collective free."""
    monkeypatch.setattr(cal, "_collective_call", lambda op, nbytes, device, world: lambda: None)
    monkeypatch.setattr(cal, "_blocking_stream", lambda collective, device: lambda: None)
    added = {1024: cal.COLLECTIVE_FLOOR_S, 65536: 2e-3, 1024**2: cal.COLLECTIVE_FLOOR_S}
    per_collective = []

    def added_times(runs, alone, device, repeats, per_run=1, rounds=cal.COLLECTIVE_ROUNDS):
        per_collective.append(per_run)
        return dict(added)

    monkeypatch.setattr(cal, "_added_times", added_times)
    back_to_back = {1024: 1e-3, 1024**2: 4e-3}
    asked = []

    def median_times(fns, device, repeats, what=""):
        asked.append(sorted(fns))
        return {n: back_to_back[n] for n in fns}

    monkeypatch.setattr(cal, "_median_times", median_times)
    cal.WARNINGS.clear()
    fitted = cal._collective_fit(
        "all_reduce", tuple(added), torch.device("cpu"), 2, 5, cal.Progress(3, False)
    )
    assert per_collective == [2 * cal.STREAM_PIECES]  # the stream's collectives, each
    assert asked == [[1024, 1024**2]]  # only the messages at the floor
    assert fitted is not None and fitted["alpha"] > 0 and fitted["beta"] > 1e-12
    (warning,) = cal.WARNINGS
    assert warning.startswith("all_reduce: 2 of 3 messages added nothing measurable")
