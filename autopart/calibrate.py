"""Measure this machine into a device profile: `autopart calibrate --out profile.json`.

    launch        one tiny operator, many back to back: `kernel_launch_s`.
    matmul        n×n @ n×n for each size and dtype, median time t(n). The compute
                  model's curve, efficiency n/(n + n½) of a peak P plus the launch, says
                  t(n) − launch = 2n³/P + 2n²·n½/P: linear in 1/P and n½/P, fitted by
                  least squares on relative error over the sizes that take at least 4
                  launches. A fit that extrapolates P beyond 1.25× the best measured
                  rate (the curve has not saturated, or is noisy) keeps P at the best
                  rate and fits n½ alone. P becomes `peak_flops[dtype]` and
                  `matmul_efficiency` is 1.0 (a measured peak is achievable).
    memory        a large copy: 2 × its bytes (read and written) over the median time.
    collectives   all_reduce, all_gather, reduce_scatter, broadcast and all_to_all (each
                  where the backend supports it) of 1 KiB to 64 MiB buffers, timed on
                  every rank and taking the slowest. t(M) = A + B·M is fitted by least
                  squares on relative error and stored per ring step and per byte sent:
                  alpha = A / ring_steps(op, world), beta = B / ring_volume(op, world),
                  which `cost_models.comm.CommModel` reads. The all-reduce's figures
                  also become the link latency and bandwidth (intra-node on one node,
                  inter-node across several).

Run it in one process (world 1: no collectives) or under `torchrun` (Gloo on CPUs,
NCCL on GPUs; every rank runs it, rank 0 writes the profile and draws the progress bar
on stderr). `autopart.mesh.device_spec(path)` and `Mesh.cluster(path, ...)` read it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from autopart.cost_models.comm import ring_steps, ring_volume
from autopart.mesh import PRESETS, DeviceSpec, Mesh

DEFAULT_SIZES = (128, 256, 512, 1024, 2048)
QUICK_SIZES = (64, 128, 256)
MESSAGE_SIZES = tuple(1024 * 4**i for i in range(9))  # 1 KiB ... 64 MiB
QUICK_MESSAGES = (1024, 64 * 1024, 1024**2)
COPY_BYTES = 256 * 1024**2
MAX_EXTRAPOLATION = 1.25  # a fitted peak may exceed the best measured rate by this much
SAMPLE_S = 0.01  # the length of one timing sample of a batched measurement
QUICK_COPY_BYTES = 16 * 1024**2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")


class Progress:
    """A text progress bar on stderr, drawn only where `enabled` (rank 0)."""

    def __init__(self, total: int, enabled: bool, width: int = 30) -> None:
        self.total, self.enabled, self.width, self.done = total, enabled, width, 0

    def step(self, label: str) -> None:
        self.done += 1
        if self.enabled:
            filled = self.width * self.done // max(self.total, 1)
            bar = "#" * filled + "." * (self.width - filled)
            sys.stderr.write(f"\r[{bar}] {self.done}/{self.total} {label:<32}")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def calibrate(
    output_path: str | os.PathLike,
    sizes: Sequence[int] = DEFAULT_SIZES,
    dtypes: Sequence[str] | None = None,
    messages: Sequence[int] = MESSAGE_SIZES,
    copy_bytes: int = COPY_BYTES,
    repeats: int = 5,
    name: str | None = None,
) -> DeviceSpec:
    """Measure the local device (and the running world's collectives) and write the
    profile to `output_path` (rank 0). Returns the profile on every rank."""
    _join_launched_world()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else (
        torch.device("cpu")
    )
    dtypes = tuple(dtypes or (("fp32", "bf16", "fp16") if device.type == "cuda" else ("fp32",)))
    ops = COLLECTIVE_OPS if world > 1 else ()
    progress = Progress(len(dtypes) * len(sizes) + 2 + len(ops) * len(messages), rank == 0)

    launch = _launch_time(device)
    progress.step("kernel launch")
    peaks, half_dims = {}, {}
    for dtype in dtypes:
        measured = {n: _matmul_time(n, DTYPES[dtype], device, repeats, progress) for n in sizes}
        peaks[dtype], half_dims[dtype] = fit_matmul_curve(measured, launch)
    bandwidth = _copy_bandwidth(copy_bytes, device, repeats)
    progress.step("memory bandwidth")
    collectives = {}
    for op in ops:
        fitted = _collective_fit(op, messages, device, world, repeats, progress)
        if fitted is not None:
            collectives[op] = fitted

    spec = _profile(device, world, name, peaks, bandwidth, launch, collectives)
    spec = replace(spec, matmul_half_dim=half_dims[dtypes[0]])
    if rank == 0:
        Path(output_path).write_text(json.dumps(spec.to_json(), indent=2) + "\n")
        _report(spec, half_dims, output_path)
    return spec


def fit_matmul_curve(seconds_by_dim: dict[int, float], launch: float) -> tuple[float, float]:
    """(P, n½) with t(n) = launch + 2n³/(P · n/(n + n½)) = launch + (2n³ + 2n²·n½)/P,
    over the sizes that take at least 4 launches (see the module docstring)."""
    best = max(2 * n**3 / t for n, t in seconds_by_dim.items())
    rows = [(2 * n**3, 2 * n**2, t - launch) for n, t in seconds_by_dim.items() if t >= 4 * launch]
    if not rows:
        return best, 0.0
    a, b = _relative_fit(rows) if len(rows) > 1 else (0.0, 0.0)
    if a > 0 and b >= 0 and 1 / a <= MAX_EXTRAPOLATION * best:
        return 1 / a, b / a
    # P fixed at the best rate: the relative residual of a row is c + d·n½ with
    # c = x1/(P·y) − 1 and d = x2/(P·y), minimized by n½ = −Σcd / Σd².
    cd = [(x1 / (best * y) - 1, x2 / (best * y)) for x1, x2, y in rows]
    half = -sum(c * d for c, d in cd) / sum(d * d for _, d in cd)
    return best, max(half, 0.0)


def _relative_fit(rows: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """(a, b) minimizing Σ ((a·x1 + b·x2 − y) / y)² over rows (x1, x2, y): least squares
    on relative error, so small and large measurements count alike (2×2 normal
    equations)."""
    xs = [(x1 / y, x2 / y) for x1, x2, y in rows]
    s11 = sum(u * u for u, _ in xs)
    s12 = sum(u * v for u, v in xs)
    s22 = sum(v * v for _, v in xs)
    t1, t2 = sum(u for u, _ in xs), sum(v for _, v in xs)
    det = s11 * s22 - s12 * s12
    if not det:
        return t1 / s11, 0.0
    return (t1 * s22 - t2 * s12) / det, (s11 * t2 - s12 * t1) / det


# -- measurements --------------------------------------------------------------------


def _median_time(
    fn: Callable[[], object], device: torch.device, repeats: int, batched: bool = False
) -> float:
    """The median seconds of one call. `batched` runs enough calls back to back per
    sample (about 10 ms) that the synchronization at its ends does not count."""
    inner = 1
    first = _timed(fn, device, 1)  # also the warm-up: allocation, kernel selection
    if batched:
        inner = max(1, min(100, int(SAMPLE_S / max(first, 1e-9))))
    return statistics.median(_timed(fn, device, inner) for _ in range(repeats))


def _timed(fn: Callable[[], object], device: torch.device, calls: int) -> float:
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / calls


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _matmul_time(
    n: int, dtype: torch.dtype, device: torch.device, repeats: int, progress: Progress
) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    seconds = _median_time(lambda: a @ b, device, repeats, batched=True)
    progress.step(f"matmul {str(dtype).removeprefix('torch.')} {n}")
    return seconds


def _copy_bandwidth(nbytes: int, device: torch.device, repeats: int) -> float:
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_time(lambda: dst.copy_(src), device, repeats, batched=True)


def _launch_time(device: torch.device, count: int = 200) -> float:
    """Per operator: `count` tiny additions back to back, synchronized once."""
    x = torch.zeros(1, device=device)
    x.add_(1)
    return _timed(lambda: x.add_(1), device, count)


def _collective_fit(
    op: str,
    messages: Sequence[int],
    device: torch.device,
    world: int,
    repeats: int,
    progress: Progress,
) -> dict[str, float] | None:
    """{"alpha": s per ring step, "beta": s per byte sent}, or None where the backend
    does not support `op`."""
    times = []
    for i, nbytes in enumerate(messages):
        try:
            times.append(_collective_time(op, nbytes, device, world, repeats))
        except (RuntimeError, NotImplementedError, ValueError):  # the backend lacks `op`
            for _ in messages[i:]:
                progress.step(f"{op} (unsupported)")
            return None
        progress.step(f"{op} {nbytes // 1024} KiB")
    intercept, slope = _relative_fit([(1.0, float(m), t) for m, t in zip(messages, times)])
    return {
        "alpha": max(intercept, 0.0) / ring_steps(op, world),
        "beta": max(slope, 1e-15) / ring_volume(op, world),
    }


def _collective_time(
    op: str, nbytes: int, device: torch.device, world: int, repeats: int
) -> float:
    """The slowest rank's median time for `op` of an `nbytes` buffer."""
    numel = max(world, nbytes // 4 // world * world)
    full = torch.ones(numel, device=device)
    part = torch.ones(numel // world, device=device)
    run = {
        "all_reduce": lambda: dist.all_reduce(full),
        "all_gather": lambda: dist.all_gather(list(full.chunk(world)), part),
        "reduce_scatter": lambda: dist.reduce_scatter(part, list(full.chunk(world))),
        "broadcast": lambda: dist.broadcast(full, src=0),
        "all_to_all": lambda: dist.all_to_all_single(torch.empty_like(full), full),
    }[op]
    dist.barrier()
    seconds = torch.tensor([_median_time(run, device, repeats)], device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds)


# -- the profile ---------------------------------------------------------------------


def _join_launched_world() -> None:
    """Under torchrun, join its world (Gloo on CPU, NCCL on GPU) as `Mesh.local` does."""
    if not dist.is_initialized() and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        Mesh.local()


def _profile(
    device: torch.device,
    world: int,
    name: str | None,
    peaks: dict[str, float],
    bandwidth: float,
    launch: float,
    collectives: dict[str, dict[str, float]],
) -> DeviceSpec:
    base = _base_spec(device)
    links = {}
    if "all_reduce" in collectives:
        measured = collectives["all_reduce"]
        level = "inter" if world > int(os.environ.get("LOCAL_WORLD_SIZE", world)) else "intra"
        links = {
            f"{level}_node_bandwidth": 1 / measured["beta"],
            f"{level}_node_latency": measured["alpha"],
        }
    return replace(
        base,
        name=name or f"{base.name}-calibrated",
        peak_flops=peaks,
        memory_bytes=_memory_bytes(device),
        memory_bandwidth=bandwidth,
        kernel_launch_s=launch,
        matmul_efficiency=1.0,
        collectives=collectives,
        **links,
    )


def _base_spec(device: torch.device) -> DeviceSpec:
    """The preset whose unmeasured figures (links on one process) the profile keeps."""
    if device.type != "cuda":
        return PRESETS["cpu"]
    gpu = torch.cuda.get_device_name(device).lower()
    return PRESETS["a100-80g" if "a100" in gpu else "h100-80g"]


def _memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _report(spec: DeviceSpec, half_dims: dict[str, float], path: str | os.PathLike) -> None:
    peaks = ", ".join(
        f"{k} {v / 1e9:.1f} GFLOP/s (half at n≈{half_dims[k]:.0f})"
        for k, v in spec.peak_flops.items()
    )
    sys.stderr.write(
        f"{spec.name}: {peaks}; memory {spec.memory_bandwidth / 1e9:.1f} GB/s; "
        f"launch {spec.kernel_launch_s * 1e6:.1f} µs; collectives {sorted(spec.collectives)}\n"
        f"wrote {path}\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """`autopart calibrate --out profile.json [--quick] [--name NAME] [--dtypes fp32,bf16]`."""
    parser = argparse.ArgumentParser(prog="autopart calibrate", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the device profile JSON")
    parser.add_argument("--quick", action="store_true", help="few sizes: seconds, not minutes")
    parser.add_argument("--name", help="the profile's device name")
    parser.add_argument("--dtypes", help="comma-separated: fp32,bf16,fp16")
    args = parser.parse_args(argv)
    options = {}
    if args.quick:
        options = {"sizes": QUICK_SIZES, "messages": QUICK_MESSAGES, "copy_bytes": QUICK_COPY_BYTES}
    dtypes = args.dtypes.split(",") if args.dtypes else None
    calibrate(args.out, dtypes=dtypes, name=args.name, **options)
    return 0


if __name__ == "__main__":
    sys.exit(main())
