"""Measure this machine into a device profile: `autopart calibrate --out profile.json`.

    floor         a small standard block (a transformer encoder layer of width 16)
                  captured as autopart runs models and trained forward and backward at a
                  size where its arithmetic is negligible: seconds per operator, counted
                  as the compute model counts them, become `kernel_launch_s`. On a CPU
                  that is each operator's dispatch (the generated code's call, the
                  dispatcher, autograd's recording and the engine's backward node): a
                  multiplication of two scalars, 3 µs; a graph operator, which may run
                  several (a linear layer: a transpose and a matmul, in backward two
                  matmuls and a sum), about 9 µs on a 2-core x86 host.
    matmul        a linear layer's three products (`cost_models.compute.LINEAR_PRODUCTS`:
                  forward x @ Wᵀ, input gradient g @ W, weight gradient gᵀ @ x) of n×n
                  operands, each in its own operand layout, for each size and dtype
                  (fp32 and bf16 by default; 128 to 2048 on a CPU, 16-bit ones to 1024
                  there, 256 to 8192 on a GPU), median time t(n). The compute model's
                  curve, efficiency n/(n + n½) of a peak P plus a call's overhead c (a
                  1×1 product in the same layout), says t(n) − c = 2n³/P + 2n²·n½/P:
                  linear in 1/P and n½/P, fitted by least squares on relative error over
                  the sizes that take at least 4 calls. A fit that extrapolates P beyond
                  1.25× the best rate of those sizes (the curve has not saturated, or is
                  noisy) keeps P at that rate and fits n½ alone. Each product's (P, n½)
                  goes to `matmul_products[dtype]`; the input gradient's, both operands
                  as stored, is also `peak_flops[dtype]` and `matmul_half_dim` (the
                  first dtype's), which price other contractions. `matmul_efficiency` is
                  1.0 (a measured peak is achievable).
    attention     on a CPU, fused attention (`scaled_dot_product_attention`) of a few
                  shapes per dtype, causal and full, forward and backward: t less the
                  operator floor = FLOPs · f + rows · r (rows: batch × heads × queries),
                  fitted by least squares on relative error: `attention_rates[dtype]`.
    memory        a large copy: 2 × its bytes (read and written) over the median time.
    functions     on a CPU, each transcendental the compute model prices by its
                  evaluations (`cost_models.work.FUNCTIONS`: exp, tanh, gelu, ...) on
                  fp32 tensors of 16 Ki and 128 Ki elements, which stay in cache as the
                  activations of the operators they model do: the difference in
                  elements over the difference in time is `function_rates[fn]`.
    optimizer     AdamW's step over a small transformer layer's parameters (width
                  128), timed right after that layer's forward and backward, as a
                  training step runs it: the backward has evicted the parameters, the
                  state and the step's code from the caches. Less its traffic at the
                  measured bandwidth, over its tensors: `optimizer_tensor_s`. (On a
                  2-core x86 host, 35 µs a tensor; back to back on 16-element
                  tensors it measured 16 µs, half of what the tiny GPT-2's and
                  Llama's steps take after their backward.)
    collectives   all_reduce, all_gather, reduce_scatter, broadcast and all_to_all
                  (each where the backend supports it) of 1 KiB to 64 MiB buffers,
                  each issued between compute as training issues it: what it adds to
                  the world's time (`_added_times`). On a CPU, where Gloo blocks the
                  calling rank and each collective is a rendezvous of ranks that were
                  computing, on cores time-sliced with whatever else runs, a stream of
                  them: a small layer's forward and backward over pieces of its
                  tokens, one collective after each piece (`_blocking_stream`), as
                  tensor parallelism issues its reductions between a block's layers;
                  on a GPU one after a burst of compute. All-gather and
                  reduce-scatter in their single-tensor forms, which runtimes use (on
                  Gloo the list forms take up to 3× longer). Send/recv too, as a ring
                  shift (each rank sends to the next, as pipeline stages do): on a GPU
                  timed back to back, since a stage waits for its peer idle and what
                  its peer's compute costs it is the schedule's bubble; on a CPU in
                  the stream, as the other collectives (`_collective_fit`); and the
                  same shift as an exchange between compute, as ring attention passes
                  its keys and values on between the pairs it computes. t(M) = A + B·M is
                  fitted by least squares on relative error and stored per ring step
                  and per byte sent: alpha = A / ring_steps(op, world), beta = B /
                  ring_volume(op, world), which `cost_models.comm.CommModel` reads
                  (send/recv prices a pipeline's transfers). The all-reduce's figures
                  also become the link latency and bandwidth (intra-node on one node,
                  inter-node across several).
    ZeRO-3        on a CPU with all-gather and reduce-scatter measured: what one
                  bucket's gather in forward, gather in backward and reduce-scatter
                  add to a step, run as ZeRO-3 runs them (prefetched one bucket ahead,
                  reduced while backward goes on) over a stream of small layers
                  against the same layers alone, fitted per ring step and per byte of
                  the bucket as the collectives are: `DeviceSpec.zero3_bucket`.
    scale         last, a small transformer layer (width 128, 512 tokens) run forward and
                  backward, against the compute model's price for it with all of the
                  above: `compute_scale`, measured / modeled, by which the compute model
                  multiplies every operator. It carries what the per-operator roofline
                  does not see (operands evicted from cache by the operator before, a
                  CPU's attention kernel at small head dims), fitted on a standard layer,
                  not on a model being planned.

Every timing but the collectives' and the optimizer's is the median of samples of
back-to-back calls lasting `SAMPLE_S` each, so that on a CPU shared by more ranks than
cores a sample sees the rank's share of a core; the sizes of one fit (matmuls,
messages) are sampled in turn, round after round, so that a change of the machine's
load does not bend the fitted curve.

A measurement sampled so is repeated until its last samples agree
(`sample_until_stable`), or warned of as unstable with their spread; a figure outside
its plausible range (`PLAUSIBLE`) is warned of too. The profile's `calibration` records
the device type and world size it was measured on (the cost models read the device
from it, not from the profile's name), the warnings, and the host's load averages
before and after the run.

Run it in one process (world 1: no collectives) or under `torchrun` (Gloo on CPUs,
NCCL on GPUs; every rank runs it side by side and the profile holds the ranks' mean;
rank 0 writes it and draws the progress bar on stderr). `autopart.mesh.device_spec(path)`
and `Mesh.cluster(path, ...)` read it.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from autopart.capture import BATCH, capture
from autopart.cost_models.comm import ring_steps, ring_volume
from autopart.cost_models.compute import LINEAR_PRODUCTS, ComputeModel, backward_factor
from autopart.cost_models.work import FUNCTIONS, node_work
from autopart.mesh import PRESETS, DeviceSpec, Mesh, gpu_preset
from autopart.ops.flat_buckets import REDUCE_DEPTH
from autopart.passes import analyze
from autopart.runtime.host_memory import keep_freed_memory

DEFAULT_SIZES = (128, 256, 512, 1024, 2048)
# On a CPU without 16-bit instructions a 16-bit product runs at a few GFLOP/s: sizes up
# to this dim keep a calibration within minutes there.
CPU_HALF_MAX_DIM = 1024
# Fused attention's shapes (batch, heads, queries = keys, head dim): at the same rows,
# FLOPs 4× apart, then other rows and head dims, small enough for a CPU's bf16 backward.
ATTENTION_SHAPES = ((8, 4, 64, 32), (2, 4, 256, 32), (4, 4, 128, 16), (2, 2, 128, 64))
# A GPU's matmuls saturate only at thousands (an H100's bf16 rate at 2048 is about half
# its rate at 8192): sizes that stop short would cap the fitted peak (MAX_EXTRAPOLATION).
GPU_SIZES = (256, 512, 1024, 2048, 4096, 8192)
QUICK_SIZES = (64, 128, 256)
MESSAGE_SIZES = tuple(1024 * 4**i for i in range(9))  # 1 KiB ... 64 MiB
# Up to a gradient bucket's order of size: a step's tensor-parallel gathers and gradient
# buckets reach them, and on a CPU time-sliced among its ranks the rendezvous outweighs
# the transfer up to a few MiB, where a fit cannot see the per-byte cost.
QUICK_MESSAGES = (1024, 64 * 1024, 1024**2, 4 * 1024**2, 16 * 1024**2)
COPY_BYTES = 256 * 1024**2
MAX_EXTRAPOLATION = 1.25  # a fitted peak may exceed the best measured rate by this much
# The length of one timing sample. On a CPU shared by more runnable processes than it has
# cores (a world of 4 ranks on 2 cores, or other jobs), the scheduler time-slices them
# every few milliseconds: a sample must span several slices to see the rank's share of
# a core, not a burst at full speed (128² matmuls in a world of 4 on 2 cores measured
# 60 µs in 2 ms samples, 170 µs in 10 ms and 187 µs in 50 ms ones).
SAMPLE_S = 0.05
MAX_CALLS_PER_SAMPLE = 100_000
# A measurement is stable when the spread (max − min over the median) of its last
# `STABLE_WINDOW` samples is at most `STABLE_SPREAD`. Past the `repeats` rounds asked
# for, the unstable ones are sampled again, round after round, up to `MAX_ROUND_FACTOR`
# × `repeats` rounds in all (--quick stays quick); one still unstable then is kept, at
# its median, with a warning naming it and its spread.
STABLE_WINDOW = 5
STABLE_SPREAD = 0.10
MAX_ROUND_FACTOR = 2
# Plausible ranges of the measured figures, per kind: a figure outside is kept but
# warned of, since it says more about the host (another job, a throttled core) than
# about the device.
#   matmul peak   a CPU core's BLAS runs well above 1 GFLOP/s (one AVX2 FMA unit at
#                 1 GHz: 16 fp32 FLOP a cycle), a whole CPU below 20 TFLOP/s; a GPU
#                 above 100 GFLOP/s and, dense, below 5 PFLOP/s (a B200's fp16 is 2.25);
#                 a CPU without 16-bit instructions converts every 16-bit element, and
#                 in some operand layouts runs its 16-bit products below 1 GFLOP/s
#   memory copy   a DDR channel streams several GB/s; HBM3e about 8 TB/s
#   functions     torch evaluates exp, tanh, gelu, ... vectorized (Sleef): a core
#                 reaches about 1 G/s or more, and libm's scalar calls 50 M/s; above
#                 20 G/s a thread (16 fp32 lanes at 3 GHz, one evaluation per lane and
#                 about 2.5 cycles) is the timer's noise, not arithmetic
#   operator      an operator's dispatch costs microseconds (9 µs on a 2-core x86 host);
#                 a millisecond is another process's time slice, not dispatch
#   compute scale the measured over the modeled reference layer: beyond 5× either way
#                 the model or the measurement is wrong
PLAUSIBLE: dict[str, tuple[float, float]] = {
    "matmul cpu": (1e9, 2e13),
    "matmul cpu 16-bit": (1e8, 2e13),
    "matmul cuda": (1e11, 5e15),
    "memory bandwidth": (1e9, 1.5e13),
    "function": (2e8, 2e10),  # per thread: the upper bound times torch's threads
    "operator floor": (5e-7, 2e-4),
    "compute scale": (0.2, 5.0),
}
FLOOR_WIDTH = 16  # the model width of the operator-floor measurement
REFERENCE_WIDTH = 128  # the model width of the compute-scale measurement
COLLECTIVE_SAMPLES = 9  # per message size, each `COLLECTIVE_ROUNDS` of compute and collective
COLLECTIVE_ROUNDS = 8
COLLECTIVE_FLOOR_S = 1e-6  # the least a collective is taken to add
BURST_WIDTH = 64  # the model width of the layer trained before each timed collective
BURST_BATCH = (8, 64)  # its input: sequences, tokens each
# The buckets of the ZeRO-3 stream measured on a CPU (`_zero3_stream`): the burst's
# tokens split over this many, each bucket's compute a quarter of the burst's.
ZERO3_STREAM_BUCKETS = 4
# The pieces of the burst's tokens between which a CPU's collectives are timed
# (`_blocking_stream`): a collective after each piece's forward and backward, as many
# per step as tensor parallelism issues in a block or two.
STREAM_PIECES = 4
STREAM_ROUNDS = 2  # steps of the stream per sample: 16 collectives, twice the burst's 8
QUICK_COPY_BYTES = 16 * 1024**2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
COLLECTIVE_OPS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "all_to_all",
    "send_recv",
    "exchange",
)
K = TypeVar("K")


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
    sizes: Sequence[int] | None = None,
    dtypes: Sequence[str] | None = None,
    messages: Sequence[int] = MESSAGE_SIZES,
    copy_bytes: int = COPY_BYTES,
    repeats: int = 5,
    name: str | None = None,
    ops: Sequence[str] = COLLECTIVE_OPS,
) -> DeviceSpec:
    """Measure the local device (and the running world's collectives `ops`) and write
    the profile to `output_path` (rank 0). Returns the profile on every rank."""
    _join_launched_world()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    load_before = _load()
    WARNINGS.clear()
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else (torch.device("cpu"))
    )
    if device.type == "cpu":
        keep_freed_memory()  # measured as the runtime runs (runtime/host_memory.py)
    dtypes = tuple(
        dtypes or (("fp32", "bf16", "fp16") if device.type == "cuda" else ("fp32", "bf16"))
    )
    sizes = sizes or (GPU_SIZES if device.type == "cuda" else DEFAULT_SIZES)
    ops = ops if world > 1 else ()
    # On a CPU, where collectives cannot hide behind compute, ZeRO-3's are measured as
    # it runs them too.
    stream = device.type == "cpu" and {"all_gather", "reduce_scatter"} <= set(ops)
    attention = device.type == "cpu"
    steps = len(dtypes) * (len(sizes) * len(LINEAR_PRODUCTS) + attention)
    steps += 5 + (len(ops) + stream) * len(messages)
    progress = Progress(steps, rank == 0)

    launch = _operator_floor(device, repeats)
    progress.step("operator floor")
    products: dict[str, dict[str, dict[str, float]]] = {}
    for dtype in dtypes:
        products[dtype] = {}
        for product in LINEAR_PRODUCTS:
            measured = _product_times(
                _sizes_for(sizes, dtype, device), dtype, product, device, repeats
            )
            call = measured.pop(1)
            peak, half = fit_matmul_curve(measured, call)
            products[dtype][product] = {"peak": peak, "half_dim": half}
            for n in sizes:
                progress.step(f"matmul {dtype} {product} {n}")
    plain = {dtype: fits["grad_input"] for dtype, fits in products.items()}  # both as stored
    attention_rates = {}
    for dtype in dtypes if attention else ():
        attention_rates[dtype] = _attention_fits(dtype, launch, device, repeats)
        progress.step(f"attention {dtype}")
    bandwidth = _copy_bandwidth(copy_bytes, device, repeats)
    progress.step("memory bandwidth")
    rates = _function_rates(device, repeats) if device.type == "cpu" else {}
    progress.step("transcendental functions")
    optimizer = _optimizer_per_tensor(device, repeats)
    progress.step("optimizer")
    collectives = {}
    for op in ops:
        fitted = _collective_fit(op, messages, device, world, repeats, progress)
        if fitted is not None:
            collectives[op] = fitted
    zero3_bucket = _zero3_bucket_fit(messages, device, world, repeats) if stream else {}
    for nbytes in messages if stream else ():
        progress.step(f"ZeRO-3 bucket {nbytes // 1024} KiB")

    peaks = {dtype: fit["peak"] for dtype, fit in plain.items()}
    spec = _profile(device, world, name, peaks, bandwidth, launch, collectives)
    spec = replace(
        spec,
        matmul_half_dim=plain[dtypes[0]]["half_dim"],
        matmul_products=products,
        attention_rates=attention_rates,
        function_rates=rates,
        optimizer_tensor_s=optimizer,
        zero3_bucket=zero3_bucket,
    )
    spec = replace(spec, compute_scale=_compute_scale(spec, device, repeats))
    progress.step("compute scale")
    for warning in implausible(spec, device.type, torch.get_num_threads()):
        _warn(warning)
    spec = replace(
        spec,
        calibration={
            "device_type": device.type,
            "world_size": world,
            "load_before": load_before,
            "load_after": _load(),
            "cpus": os.cpu_count(),
            "warnings": list(WARNINGS),
        },
    )
    if rank == 0:
        Path(output_path).write_text(json.dumps(spec.to_json(), indent=2) + "\n")
        _report(spec, output_path)
    return spec


def fit_matmul_curve(seconds_by_dim: dict[int, float], launch: float) -> tuple[float, float]:
    """(P, n½) with t(n) = launch + 2n³/(P · n/(n + n½)) = launch + (2n³ + 2n²·n½)/P,
    over the sizes that take at least 4 launches (see the module docstring). The best
    rate is taken over those sizes too: on a CPU a matmul small enough for the L1 cache
    (64² operands) can outrun every larger one, a rate the sizes that matter never see."""
    fitted = {n: t for n, t in seconds_by_dim.items() if t >= 4 * launch} or seconds_by_dim
    best = max(2 * n**3 / t for n, t in fitted.items())
    rows = [(2 * n**3, 2 * n**2, t - launch) for n, t in fitted.items() if t >= 4 * launch]
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


def _median_times(
    fns: Mapping[K, Callable[[], object]], device: torch.device, repeats: int, what: str = ""
) -> dict[K, float]:
    """The median seconds of one call of each of `fns`, averaged over the world's ranks
    (`_world_mean`). A sample runs enough calls back to back (about `SAMPLE_S`) that the
    synchronization at its ends does not count and the scheduler's time slices average
    out; the samples go round all of `fns` in turn, so that a change of the machine's
    load hits each alike. In a world every rank runs the same calls per sample (the
    most any rank needs) from a barrier on: ranks that share cores then measure side by
    side, and none finishes early and leaves the others a freer core (on 4 ranks on 2
    cores, where ranks drifted apart, the profile rank 0 wrote varied 3× from one
    calibration to the next)."""
    counts = {}
    for key, fn in fns.items():
        _timed(fn, device, 1)  # the warm-up: allocation, kernel selection
        counts[key] = _calls_per_sample(_timed(fn, device, 10))
    agreed = _across_ranks(list(counts.values()), device, dist.ReduceOp.MAX)
    counts = {key: int(n) for key, n in zip(counts, agreed)}
    _together()
    samples, unsettled = sample_until_stable(
        lambda key: _timed(fns[key], device, counts[key]),
        list(fns),
        repeats,
        lambda flags: [f > 0 for f in _across_ranks(flags, device, dist.ReduceOp.MAX)],
    )
    for key, spread in unsettled.items():
        _warn(
            _measurement(what, key, len(fns)) + f": not stable after {len(samples[key])} samples, "
            f"the last {STABLE_WINDOW} spread {spread:.0%} of their median (at most "
            f"{STABLE_SPREAD:.0%} asked); the host may be busy"
        )
    return _world_mean({key: statistics.median(times) for key, times in samples.items()}, device)


def _measurement(what: str, key: object, count: int) -> str:
    """A measurement's name in a warning: `what`, and its key where there are several."""
    if count == 1:
        return what or "measurement"
    parts = key if isinstance(key, tuple) else (key,)
    return " ".join([what, *map(str, parts)]).strip()


def spread(samples: Sequence[float]) -> float:
    """(max − min) / median of `samples`: 0 for fewer than two."""
    if len(samples) < 2:
        return 0.0
    middle = statistics.median(samples)
    return (max(samples) - min(samples)) / middle if middle > 0 else 0.0


def sample_until_stable(
    take: Callable[[K], float],
    keys: Sequence[K],
    repeats: int,
    agree: Callable[[list[float]], list[bool]] | None = None,
) -> tuple[dict[K, list[float]], dict[K, float]]:
    """Samples of each of `keys` (`take(key)`), round after round over the keys in
    turn: `repeats` rounds, then more of the keys whose last `STABLE_WINDOW` samples
    spread more than `STABLE_SPREAD`, up to `MAX_ROUND_FACTOR` × `repeats` rounds.
    `agree` turns each key's 1.0 (unstable) or 0.0 into whether to go on, the same on
    every rank (alone: the flags as they are). Returns the samples and the spread of
    each key still unstable."""
    samples: dict[K, list[float]] = {key: [] for key in keys}
    todo = list(keys)
    rounds, most = 0, max(repeats, MAX_ROUND_FACTOR * repeats)
    while todo and rounds < most:
        for key in todo:
            samples[key].append(take(key))
        rounds += 1
        if rounds >= repeats:
            flags = [float(spread(samples[k][-STABLE_WINDOW:]) > STABLE_SPREAD) for k in todo]
            again = agree(flags) if agree is not None else [f > 0 for f in flags]
            todo = [key for key, go_on in zip(todo, again) if go_on]
    return samples, {key: spread(samples[key][-STABLE_WINDOW:]) for key in todo}


WARNINGS: list[str] = []  # this calibration's, reset by `calibrate`


def _warn(message: str) -> None:
    WARNINGS.append(message)


def _load() -> list[float] | None:
    """The host's load averages over 1, 5 and 15 minutes; None where the OS has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def implausible(spec: DeviceSpec, device_type: str, threads: int) -> list[str]:
    """A warning for each measured figure of `spec` outside its `PLAUSIBLE` range."""
    found = []

    def check(name: str, value: float, kind: str, unit: str, scale: float = 1.0) -> None:
        low, high = PLAUSIBLE[kind]
        high *= scale
        if not low <= value <= high:
            found.append(
                f"{name} {value:.3g} {unit} is outside the plausible {low:.3g} to "
                f"{high:.3g} {unit}; the host may be busy, or the measurement wrong"
            )

    def matmul(dtype: str) -> str:
        wide = device_type != "cpu" or dtype in ("fp32", "fp64")
        return f"matmul {device_type}" + ("" if wide else " 16-bit")

    for dtype, peak in spec.peak_flops.items():
        check(f"matmul {dtype} peak", peak, matmul(dtype), "FLOP/s")
    for dtype, fits in spec.matmul_products.items():
        for product, fit in fits.items():
            if product != "grad_input":  # its peak is peak_flops[dtype], checked above
                check(f"matmul {dtype} {product}", fit["peak"], matmul(dtype), "FLOP/s")
    check("memory bandwidth", spec.memory_bandwidth, "memory bandwidth", "bytes/s")
    for fn, rate in spec.function_rates.items():
        check(f"function {fn}", rate, "function", "evaluations/s", max(threads, 1))
    check("operator floor", spec.kernel_launch_s, "operator floor", "s")
    check("compute scale", spec.compute_scale, "compute scale", "(measured / modeled)")
    return found


def _together() -> None:
    """In a world, wait for every rank: a measurement starts on all of them at once."""
    if _world_size() > 1:
        dist.barrier()


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _across_ranks(values: Sequence[float], device: torch.device, op: Any) -> list[float]:
    """`values` reduced by `op` (a `dist.ReduceOp`) over the world's ranks, where there
    is a world: every rank then writes and uses the same figures."""
    if _world_size() == 1:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def _world_mean(values: Mapping[K, float], device: torch.device) -> dict[K, float]:
    """Each of `values` averaged over the world's ranks: what a rank sees while its
    peers run the same, not what one rank happened to see."""
    summed = _across_ranks(list(values.values()), device, dist.ReduceOp.SUM)
    return {key: total / _world_size() for key, total in zip(values, summed)}


def _calls_per_sample(seconds_per_call: float) -> int:
    return max(1, min(MAX_CALLS_PER_SAMPLE, int(SAMPLE_S / max(seconds_per_call, 1e-9))))


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


def _sizes_for(sizes: Sequence[int], dtype: str, device: torch.device) -> tuple[int, ...]:
    """The sizes timed for `dtype`: on a CPU, 16-bit ones up to `CPU_HALF_MAX_DIM` (the
    smallest size where none is that small)."""
    if device.type == "cuda" or dtype == "fp32":
        return tuple(sizes)
    return tuple(n for n in sizes if n <= CPU_HALF_MAX_DIM) or (min(sizes),)


def _product_times(
    sizes: Sequence[int], dtype: str, product: str, device: torch.device, repeats: int
) -> dict[int, float]:
    """A linear layer's `product` of n×n operands for each size, and of 1×1 ones under
    the key 1: a call's own cost."""
    calls = {n: _product_call(n, DTYPES[dtype], product, device) for n in (1, *sizes)}
    return _median_times(calls, device, repeats, f"matmul {dtype} {product}")


def _product_call(
    n: int, dtype: torch.dtype, product: str, device: torch.device
) -> Callable[[], object]:
    """One of a linear layer's products (y = x @ Wᵀ, W stored out × in) in its operands'
    layout: forward x @ Wᵀ, grad_input g @ W, grad_weight gᵀ @ x."""
    x, w, g = (torch.randn(n, n, device=device).to(dtype) for _ in range(3))
    calls: dict[str, Callable[[], object]] = {
        "forward": lambda: x @ w.t(),
        "grad_input": lambda: g @ w,
        "grad_weight": lambda: g.t() @ x,
    }
    return calls[product]


def _attention_fits(
    dtype: str, launch: float, device: torch.device, repeats: int
) -> dict[str, dict[str, dict[str, float]]]:
    """{"full" | "causal": {"forward" | "backward": {"flop_s", "row_s"}}}: fused
    attention in `dtype` over `ATTENTION_SHAPES`, each direction's time less its
    operator floors (one forward, two backward, as the compute model counts them) fitted
    as FLOPs · flop_s + rows · row_s, the FLOPs counted full (4 · rows · keys · head
    dim, 2× backward), causal or not, as the compute model counts them."""
    calls: dict[tuple[str, str, int], Callable[[], object]] = {}
    for causal in (False, True):
        for i, shape in enumerate(ATTENTION_SHAPES):
            mask = "causal" if causal else "full"
            forward, both = _attention_calls(shape, DTYPES[dtype], causal, device)
            calls[(mask, "forward", i)], calls[(mask, "both", i)] = forward, both
    times = _median_times(calls, device, repeats, f"attention {dtype}")
    fits: dict[str, dict[str, dict[str, float]]] = {}
    for mask in ("full", "causal"):
        rows: dict[str, list[tuple[float, float, float]]] = {"forward": [], "backward": []}
        for i, (batch, heads, length, head) in enumerate(ATTENTION_SHAPES):
            queries = batch * heads * length
            flops = 4.0 * queries * length * head
            ahead = times[(mask, "forward", i)]
            back = times[(mask, "both", i)] - ahead
            rows["forward"].append((flops, queries, max(ahead - launch, 1e-9)))
            rows["backward"].append((2 * flops, queries, max(back - 2 * launch, 1e-9)))
        fits[mask] = {direction: _rows_and_flops(r) for direction, r in rows.items()}
    return fits


def _attention_calls(
    shape: tuple[int, int, int, int], dtype: torch.dtype, causal: bool, device: torch.device
) -> tuple[Callable[[], object], Callable[[], object]]:
    """Fused attention of `shape` (batch, heads, length, head dim): its forward, and its
    forward and backward."""
    q, k, v = (torch.randn(shape, device=device).to(dtype).requires_grad_() for _ in range(3))
    grad = torch.randn(shape, device=device).to(dtype)
    attend = partial(torch.nn.functional.scaled_dot_product_attention, q, k, v, is_causal=causal)
    return attend, lambda: attend().backward(grad)


def _rows_and_flops(rows: Sequence[tuple[float, float, float]]) -> dict[str, float]:
    """{"flop_s", "row_s"}: t = FLOPs · flop_s + rows · row_s fitted on relative error
    over (FLOPs, rows, t); where one term comes out negative, the other alone."""
    per_flop, per_row = _relative_fit(rows)
    if per_flop < 0:
        per_flop, per_row = 0.0, _one_term([(x2, y) for _, x2, y in rows])
    elif per_row < 0:
        per_flop, per_row = _one_term([(x1, y) for x1, _, y in rows]), 0.0
    return {"flop_s": per_flop, "row_s": per_row}


def _one_term(rows: Sequence[tuple[float, float]]) -> float:
    """a minimizing Σ ((a·x − y) / y)² over rows (x, y)."""
    ratios = [x / y for x, y in rows]
    return sum(ratios) / sum(r * r for r in ratios)


def _copy_bandwidth(nbytes: int, device: torch.device, repeats: int) -> float:
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    seconds = _median_times({0: lambda: dst.copy_(src)}, device, repeats, "memory copy")
    return 2 * nbytes / seconds[0]


FUNCTION_SIZES = (16 * 1024, 128 * 1024)  # elements: both in a core's cache
_FUNCTION_CALLS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "exp": torch.exp,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "erf": torch.erf,
    "log": torch.log,
    "sin": torch.sin,
    "cos": torch.cos,
}


def _function_rates(device: torch.device, repeats: int) -> dict[str, float]:
    """Evaluations per second of each function in `work.FUNCTIONS`: the slope between
    two sizes, so that the call's own cost (priced as the operator floor) cancels."""
    small, large = FUNCTION_SIZES
    calls = {
        (fn, numel): partial(_FUNCTION_CALLS[fn], torch.rand(numel, device=device) + 0.5)
        for fn in sorted(set(FUNCTIONS.values()))
        for numel in FUNCTION_SIZES
    }  # inputs in (0.5, 1.5): in every function's domain
    times = _median_times(calls, device, repeats, "function")
    rates = {}
    for fn in sorted(set(FUNCTIONS.values())):
        extra = times[(fn, large)] - times[(fn, small)]
        if extra > 0:  # else too fast to tell apart from noise: memory-bound
            rates[fn] = (large - small) / extra
    return rates


OPTIMIZER_SAMPLES = 25  # optimizer steps timed, each after a forward and backward


def _optimizer_per_tensor(device: torch.device, repeats: int) -> float:
    """Seconds per parameter tensor of AdamW's step (torch's default implementation for
    the device) beyond its traffic, as a training step runs it: the step over the
    reference layer's parameters (`_reference_layer`, width `REFERENCE_WIDTH`) less the
    step over one tensor of as many elements, taking turns, each right after the
    layer's forward and backward. Both move the same bytes, so the difference is the
    tensors' own cost at whatever speed the memory runs then; a traffic priced from the
    bandwidth measured earlier left nothing of it on a loaded host."""
    gm, x, _ = _reference_layer(REFERENCE_WIDTH, 4, 128, device)
    params = [p for p in gm.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    flat = torch.nn.Parameter(torch.zeros(numel, dtype=params[0].dtype, device=device))
    flat.grad = torch.randn_like(flat)  # nonzero moments, as a trained layer's
    steps = {
        "layer": torch.optim.AdamW(params, lr=1e-3).step,
        "one tensor": torch.optim.AdamW([flat], lr=1e-3).step,
    }
    backward = lambda: gm(x).sum().backward()  # noqa: E731
    backward()
    for step in steps.values():
        step()  # the warm-up: the state's allocation
    times: dict[str, list[float]] = {name: [] for name in steps}
    _together()
    for _ in range(max(repeats, OPTIMIZER_SAMPLES)):
        for name, step in steps.items():
            times[name].append(_median_after(backward, step, device, 1))
    seconds = _world_mean({k: statistics.median(v) for k, v in times.items()}, device)
    return max(seconds["layer"] - seconds["one tensor"], 0.0) / (len(params) - 1)


def _operator_floor(device: torch.device, repeats: int) -> float:
    """Seconds per operator of a training step, as the compute model counts them: a
    standard block (`torch.nn.TransformerEncoderLayer` of width 16, not a model being
    planned) captured as autopart captures models, run forward and backward at a size
    where its arithmetic is negligible, over its dispatched operators in forward plus
    their launches in backward (`compute.backward_factor`: 2 per contraction, 1 else)."""
    gm, x, dims = _reference_layer(FLOOR_WIDTH, 2, 8, device)
    works = [node_work(n, gm, dims, {}) for n in gm.graph.nodes]
    launches = sum(1 + backward_factor(w) for w in works if w.dispatched)
    seconds = _median_times({0: lambda: gm(x).sum().backward()}, device, repeats, "operator floor")
    return seconds[0] / launches


def _compute_scale(spec: DeviceSpec, device: torch.device, repeats: int) -> float:
    """Measured over modeled seconds of the forward and backward of a small transformer
    layer (`torch.nn.TransformerEncoderLayer`, width `REFERENCE_WIDTH`, 512 tokens),
    priced by the compute model with every other figure of this profile: what the
    per-operator roofline misses when operators run one after another in a graph."""
    gm, x, dims = _reference_layer(REFERENCE_WIDTH, 4, 128, device)
    modeled = ComputeModel(spec, half_dim=spec.matmul_half_dim).nodes_cost(gm, dims).total
    measured = _median_times({0: lambda: gm(x).sum().backward()}, device, repeats, "compute scale")[
        0
    ]
    return measured / modeled


def _reference_layer(
    width: int, batch: int, seq: int, device: torch.device
) -> tuple[torch.fx.GraphModule, torch.Tensor, dict[str, int]]:
    """A standard block, not a model being planned, captured and analyzed as autopart
    does models: the graph, an input and the sizes of its dims."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        d_model=width,
        nhead=max(2, width // 32),
        dim_feedforward=4 * width,
        dropout=0.0,
        batch_first=True,
        device=device,
    )
    x = torch.randn(batch, seq, width, device=device)
    captured = capture(layer, (x,))
    analyze(captured.gm, captured.context())
    return captured.gm, x, {**captured.dim_sizes, BATCH: batch}


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
    runs = {nbytes: _collective_call(op, nbytes, device, world) for nbytes in messages}
    try:
        for run in runs.values():
            run()  # the warm-up: connections, buffers
    except (RuntimeError, NotImplementedError, ValueError):  # the backend lacks `op`
        for _ in messages:
            progress.step(f"{op} (unsupported)")
        return None
    if op == "send_recv" and device.type != "cpu":
        # A pipeline's receiver waits for its peer, idle: a transfer adds its own time
        # back to back, not the peers' lateness after compute (the schedule's bubble).
        times = _median_times(runs, device, repeats, op)
    elif device.type == "cpu":
        # Gloo blocks the calling rank: each collective is a rendezvous of ranks that
        # were computing, priced as a layer's pieces issue them (`_blocking_stream`).
        # A pipeline's transfer too: its receiver sleeps in Gloo until the data comes,
        # and on cores time-sliced with other work its wake-up can wait for a
        # scheduler's slice. Back to back, the shift either keeps both ranks awake or
        # pays that slice on nearly every call, and which one a calibration sees
        # changes from run to run; between pieces of compute, as a stage sends after
        # its microbatch, the wake-up is paid as often as a step pays it.
        alone = _blocking_stream(None, device)
        streams = {nbytes: _blocking_stream(run, device) for nbytes, run in runs.items()}
        alone()  # the warm-up: the layer's first backward
        per_run = 2 * STREAM_PIECES
        times = _added_times(streams, alone, device, repeats, per_run, STREAM_ROUNDS)
        times |= _back_to_back_where_floored(runs, times, device, repeats, op)
    else:
        burst = _compute_burst(device)
        after = {nbytes: partial(_then, burst, run) for nbytes, run in runs.items()}
        times = _added_times(after, burst, device, repeats)
        times |= _back_to_back_where_floored(runs, times, device, repeats, op)
    fitted = _per_ring_step(op, world, times)
    for nbytes in messages:
        progress.step(f"{op} {nbytes // 1024} KiB")
    return fitted


def _back_to_back_where_floored(
    runs: Mapping[int, Callable[[], object]],
    added: Mapping[int, float],
    device: torch.device,
    repeats: int,
    op: str,
) -> dict[int, float]:
    """For the messages whose added time fell to `COLLECTIVE_FLOOR_S`, their time back to
    back. On a busy host the difference of two world times can come out at nothing or
    less, and a fit over such points prices the collective free, whereas a collective
    issued after compute takes at least what it takes back to back. Every rank holds
    the same world means, so all of them measure the same messages again or none."""
    floored = {nbytes: runs[nbytes] for nbytes, t in added.items() if t <= COLLECTIVE_FLOOR_S}
    if not floored:
        return {}
    _warn(
        f"{op}: {len(floored)} of {len(added)} messages added nothing measurable after "
        "compute; their time back to back stands for it; the host may be busy"
    )
    return _median_times(floored, device, repeats, op)


def _per_ring_step(op: str, world: int, times: Mapping[int, float]) -> dict[str, float]:
    """t(M) = A + B·M fitted on relative error, as alpha = A per ring step of `op` and
    beta = B per byte sent (`CommModel` reads them)."""
    intercept, slope = _relative_fit([(1.0, float(m), t) for m, t in times.items()])
    return {
        "alpha": max(intercept, 0.0) / ring_steps(op, world),
        "beta": max(slope, 1e-15) / ring_volume(op, world),
    }


def _collective_call(op: str, nbytes: int, device: torch.device, world: int) -> Callable[[], Any]:
    """One `op` of an `nbytes` buffer; all-gather and reduce-scatter in the
    single-tensor forms runtimes use; send/recv as pipeline stages exchange
    activations and gradients, and an exchange as ring attention's steps pass keys
    and values on (both `_ring_shift`, timed apart: `_collective_fit`)."""
    numel = max(world, nbytes // 4 // world * world)
    full = torch.ones(numel, device=device)
    part = torch.ones(numel // world, device=device)
    calls: dict[str, Callable[[], Any]] = {
        "all_reduce": lambda: dist.all_reduce(full),
        "all_gather": lambda: dist.all_gather_single(full, part),
        "reduce_scatter": lambda: dist.reduce_scatter_single(part, full),
        "broadcast": lambda: dist.broadcast(full, src=0),
        "all_to_all": lambda: dist.all_to_all_single(torch.empty_like(full), full),
        "send_recv": partial(_ring_shift, full, torch.empty_like(full), world),
        "exchange": partial(_ring_shift, full, torch.empty_like(full), world),
    }
    return calls[op]


def _ring_shift(outgoing: torch.Tensor, incoming: torch.Tensor, world: int) -> None:
    """Every rank sends `outgoing` to the next rank and receives `incoming` from the
    one before, in one batch as `torch.distributed.pipelining` issues a stage's
    transfers: each rank sends once, as a pipeline rank sends one tensor a link."""
    rank = dist.get_rank()
    ops = [
        dist.P2POp(dist.isend, outgoing, (rank + 1) % world),
        dist.P2POp(dist.irecv, incoming, (rank - 1) % world),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _then(first: Callable[[], object], second: Callable[[], object]) -> None:
    first()
    second()


def _added_times(
    runs: Mapping[int, Callable[[], object]],
    alone: Callable[[], object],
    device: torch.device,
    repeats: int,
    per_run: int = 1,
    rounds: int = COLLECTIVE_ROUNDS,
) -> dict[int, float]:
    """Seconds each of `runs` (compute with collectives) adds to the world's time over
    `alone` (the same compute without them), divided by `per_run`. A sample is the
    world's time, from a barrier to a barrier, of `rounds` calls of a run less that of
    as many calls of `alone`; the median over at least `COLLECTIVE_SAMPLES` samples,
    which go round all the runs in turn.

    A collective issued right after a burst of compute (`_collective_fit`) counts what
    a step waits for beyond a back-to-back call, the peers finishing their compute and
    the backend waking to the call (on Gloo over loopback, a 256 KiB all-reduce
    measured 0.6 ms back to back and 4 ms after 3 ms of matmuls, on a 2-core host),
    but not what one rank waits while a peer that shares its core computes: on 4 ranks
    on 2 cores, after 2 ms of matmuls, a 256 KiB all-gather added 5.0 ms to the
    world's time while its slowest rank waited 6.3 ms for it."""
    added: dict[int, list[float]] = {key: [] for key in runs}
    for _ in range(max(repeats, COLLECTIVE_SAMPLES)):
        base = _world_time(alone, device, rounds)
        for key, run in runs.items():
            added[key].append((_world_time(run, device, rounds) - base) / per_run)
    medians = _world_mean({key: statistics.median(t) for key, t in added.items()}, device)
    return {key: max(t, COLLECTIVE_FLOOR_S) for key, t in medians.items()}


def _zero3_bucket_fit(
    messages: Sequence[int], device: torch.device, world: int, repeats: int
) -> dict[str, float]:
    """{"alpha": s per ring step, "beta": s per byte sent}: what one ZeRO-3 bucket's
    three collectives (its gather in forward, again in backward, the reduce-scatter of
    its gradients) add to a step where they cannot hide behind compute, as ZeRO-3 runs
    them: a stream of `ZERO3_STREAM_BUCKETS` buckets (`_zero3_stream`) against the
    same compute alone, per bucket, fitted over `messages` (a bucket's bytes).

    Measured as a stream because on a CPU the pieces do not add up: the backend's
    threads take cycles from the ranks' compute (on 2 ranks of a 2-core host, tiny
    GPT-2's ZeRO-3 step spent 9 ms a rank in threads other than the one computing,
    data parallelism 3 ms), a gather travels while the previous bucket's
    reduce-scatter does, and issued alone, ahead of a burst of compute, one all-gather
    added 0.1 to 1.6 ms from one measurement to the next, while in the stream a bucket
    added 2.8 to 3.3 ms whatever the compute between its collectives (1.4 to 7 ms a
    bucket)."""
    alone = _zero3_stream(None, device, world)
    runs = {nbytes: _zero3_stream(nbytes, device, world) for nbytes in messages}
    for run in (alone, *runs.values()):
        run()  # the warm-up: buffers, the layer's first backward
    per_bucket = _added_times(runs, alone, device, repeats, per_run=ZERO3_STREAM_BUCKETS)
    return _per_ring_step("all_gather", world, per_bucket)


class _Done:
    """The work of a collective that was not issued (`_zero3_stream` without them)."""

    def wait(self) -> bool:
        return True


def _zero3_stream(nbytes: int | None, device: torch.device, world: int) -> Callable[[], None]:
    """One step of `ZERO3_STREAM_BUCKETS` buckets of `nbytes` each, as `ops/zero3.py`
    runs them (None: the same compute without the collectives). Each bucket computes a
    share of the burst's tokens through the burst's layer (`_compute_burst`); in forward
    a bucket's gather is issued as the previous bucket's is taken; in backward the
    first gather is issued when backward reaches it, each next one as the previous is
    taken, and each bucket's gradients are reduce-scattered after its backward, at most
    `REDUCE_DEPTH` in flight."""
    layer = _burst_layer(device)
    inputs = _burst_pieces(ZERO3_STREAM_BUCKETS, device)
    numel = max(world, (nbytes or 0) // 4 // world * world)
    shard = torch.ones(numel // world, device=device)

    def gather() -> Any:
        if nbytes is None:
            return _Done()
        full = torch.empty(numel, device=device)
        return dist.all_gather_single(full, shard, async_op=True)

    def reduce_scatter() -> Any:
        if nbytes is None:
            return _Done()
        grads = torch.ones(numel, device=device)  # a new flat buffer, as the runtime's
        return dist.reduce_scatter_single(shard.new_empty(shard.shape), grads, async_op=True)

    def step() -> None:
        last = len(inputs) - 1
        outputs = []
        pending = gather()
        for i, x in enumerate(inputs):
            pending.wait()
            pending = gather() if i < last else _Done()
            outputs.append(layer(x))
        pending = gather()
        in_flight: deque[Any] = deque()
        for i in reversed(range(len(inputs))):
            pending.wait()
            pending = gather() if i > 0 else _Done()
            outputs[i].sum().backward()
            in_flight.append(reduce_scatter())
            while len(in_flight) > REDUCE_DEPTH:
                in_flight.popleft().wait()
        for work in in_flight:
            work.wait()

    return step


def _blocking_stream(
    collective: Callable[[], object] | None, device: torch.device
) -> Callable[[], None]:
    """One step of the burst's layer over `STREAM_PIECES` pieces of its tokens, with a
    blocking `collective` after each piece's forward and each piece's backward (None:
    the same compute alone), as tensor parallelism issues its reductions between a
    block's layers."""
    layer = _burst_layer(device)
    inputs = _burst_pieces(STREAM_PIECES, device)
    then = collective or (lambda: None)

    def step() -> None:
        outputs = []
        for x in inputs:
            outputs.append(layer(x))
            then()
        for y in reversed(outputs):
            y.sum().backward()
            then()

    return step


def _burst_pieces(pieces: int, device: torch.device) -> list[torch.Tensor]:
    """The burst's input split into `pieces` inputs of as many sequences each."""
    sequences, tokens = BURST_BATCH
    shape = (sequences // pieces, tokens, BURST_WIDTH)
    return [torch.randn(shape, device=device, requires_grad=True) for _ in range(pieces)]


def _world_time(
    run: Callable[[], object], device: torch.device, rounds: int = COLLECTIVE_ROUNDS
) -> float:
    """Seconds per call of `rounds` calls of `run` on every rank, from a barrier to a
    barrier."""
    dist.barrier()
    _sync(device)
    start = time.perf_counter()
    for _ in range(rounds):
        run()
    _sync(device)
    dist.barrier()
    return (time.perf_counter() - start) / rounds


def _median_after(
    burst: Callable[[], object], fn: Callable[[], object], device: torch.device, samples: int
) -> float:
    """The median seconds of one call of `fn`, each timed alone right after a call of
    `burst` (untimed), as a training step runs it after other work."""
    times = []
    for _ in range(samples):
        burst()
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _compute_burst(device: torch.device) -> Callable[[], object]:
    """Training's own compute before a collective: a small transformer layer's forward
    and backward (width `BURST_WIDTH`, 8 × 64 tokens; about 2.5 ms on one CPU core, far
    less on a GPU). Its many small operators run for a less even time from rank to rank
    than a few large matmuls, and what a collective adds after it is the peers'
    lateness too: on 2 ranks on 2 cores a 64 KiB all-gather added 1.5 ms after this
    burst and 0.6 ms after 2.3 ms of 256² matmuls."""
    layer = _burst_layer(device)
    x = torch.randn(*BURST_BATCH, BURST_WIDTH, device=device)
    return lambda: layer(x).sum().backward()


def _burst_layer(device: torch.device) -> torch.nn.Module:
    return torch.nn.TransformerEncoderLayer(
        BURST_WIDTH, 4, 4 * BURST_WIDTH, dropout=0.0, batch_first=True, device=device
    )


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
    # Float fields of DeviceSpec by computed name, which mypy cannot match to a field.
    links: dict[str, Any] = {}
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
        sm_count=0,  # the measured curve prices contractions, not the preset's shape model
        collectives=collectives,
        **links,
    )


def _base_spec(device: torch.device) -> DeviceSpec:
    """The preset whose unmeasured figures (links on one process) the profile keeps."""
    return PRESETS[gpu_preset(device) if device.type == "cuda" else "cpu"]


def _memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _report(spec: DeviceSpec, path: str | os.PathLike) -> None:
    assert spec.optimizer_tensor_s is not None, "calibrate measures it"
    rates = ", ".join(f"{fn} {rate / 1e9:.2f}" for fn, rate in spec.function_rates.items())
    peaks = "; ".join(
        f"{dtype} "
        + ", ".join(
            f"{product} {fit['peak'] / 1e9:.1f} GFLOP/s (half at n≈{fit['half_dim']:.0f})"
            for product, fit in fits.items()
        )
        for dtype, fits in spec.matmul_products.items()
    )
    sys.stderr.write(
        f"{spec.name}: {peaks}; memory {spec.memory_bandwidth / 1e9:.1f} GB/s; "
        f"operator floor {spec.kernel_launch_s * 1e6:.1f} µs; "
        f"Adam {spec.optimizer_tensor_s * 1e6:.1f} µs a tensor; "
        f"compute scale {spec.compute_scale:.2f}; "
        f"functions (G/s) {rates or 'none'}; collectives {sorted(spec.collectives)}\n"
        + "".join(f"warning: {w}\n" for w in spec.calibration.get("warnings", ()))
        + f"host load (1, 5, 15 min) {spec.calibration.get('load_before')} before, "
        f"{spec.calibration.get('load_after')} after, on {os.cpu_count()} CPUs\n"
        f"wrote {path}\n"
    )


if __name__ == "__main__":  # the same as `autopart calibrate ...`
    from autopart.cli import main

    sys.exit(main(["calibrate", *sys.argv[1:]]))
