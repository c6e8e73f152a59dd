"""Measure this machine into a device profile: `autopart calibrate --out profile.json`.

    matmul        n×n @ n×n for each size and dtype: 2n³ FLOPs over the median time.
                  The curve flops(n) = P · n / (n + n½) (the compute model's efficiency
                  curve) is fitted by least squares on 1/flops = 1/P + (n½/P) · 1/n;
                  P, the asymptotic peak, becomes `peak_flops[dtype]` and the profile's
                  `matmul_efficiency` is 1.0 (a measured peak is achievable).
    memory        a large copy: 2 × its bytes (read and written) over the median time.
    launch        the median time of one tiny operator: `kernel_launch_s`.
    collectives   all_reduce, all_gather, reduce_scatter, broadcast and all_to_all (each
                  where the backend supports it) of 1 KiB to 64 MiB buffers, timed on
                  every rank and taking the slowest. t(M) = A + B·M is fitted by least
                  squares and stored per ring step and per byte sent:
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

    peaks, half_dims = {}, {}
    for dtype in dtypes:
        measured = {n: _matmul_flops(n, DTYPES[dtype], device, repeats, progress) for n in sizes}
        peaks[dtype], half_dims[dtype] = fit_matmul_curve(measured)
    bandwidth = _copy_bandwidth(copy_bytes, device, repeats)
    progress.step("memory bandwidth")
    launch = _launch_time(device)
    progress.step("kernel launch")
    collectives = {}
    for op in ops:
        fitted = _collective_fit(op, messages, device, world, repeats, progress)
        if fitted is not None:
            collectives[op] = fitted

    spec = _profile(device, world, name, peaks, bandwidth, launch, collectives)
    if rank == 0:
        Path(output_path).write_text(json.dumps(spec.to_json(), indent=2) + "\n")
        _report(spec, half_dims, output_path)
    return spec


def fit_matmul_curve(flops_by_dim: dict[int, float]) -> tuple[float, float]:
    """(P, n½) of flops(n) = P·n/(n + n½), by least squares on 1/flops against 1/n.
    A fit that comes out unphysical (noise on a flat curve) gives (best measured, 0)."""
    intercept, slope = _least_squares(
        [1 / n for n in flops_by_dim], [1 / f for f in flops_by_dim.values()]
    )
    if intercept <= 0 or slope < 0:
        return max(flops_by_dim.values()), 0.0
    return 1 / intercept, slope / intercept


def _least_squares(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the points."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return my - slope * mx, slope


# -- measurements --------------------------------------------------------------------


def _median_time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()  # warm-up: allocation, kernel selection
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _matmul_flops(
    n: int, dtype: torch.dtype, device: torch.device, repeats: int, progress: Progress
) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    seconds = _median_time(lambda: a @ b, device, repeats)
    progress.step(f"matmul {str(dtype).removeprefix('torch.')} {n}")
    return 2 * n**3 / seconds


def _copy_bandwidth(nbytes: int, device: torch.device, repeats: int) -> float:
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_time(lambda: dst.copy_(src), device, repeats)


def _launch_time(device: torch.device, count: int = 200) -> float:
    """Per operator: `count` tiny additions back to back, synchronized once."""
    x = torch.zeros(1, device=device)
    x.add_(1)
    _sync(device)
    start = time.perf_counter()
    for _ in range(count):
        x.add_(1)
    _sync(device)
    return (time.perf_counter() - start) / count


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
    intercept, slope = _least_squares([float(m) for m in messages], times)
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
