"""Devices, topology and the mesh autopart plans for.

A `Mesh` is a set of identical devices arranged as `nodes × per_node`. It carries a
`DeviceSpec` (peak FLOP/s, memory, links) and the `Topology` derived from it: the
bandwidth and latency of each level of the network (inside a node, between nodes).
`Mesh.cluster(...)` describes hardware for planning only; `Mesh.local()` describes the
running torch.distributed world and can build the named `DeviceMesh` a plan runs on.

Preset figures come from the vendors' public data sheets (dense math, no sparsity;
link bandwidth per direction per device). `Mesh` also accepts a device profile JSON
written by `autopart calibrate` in place of a preset name.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend  # the options DeviceMesh takes
from torch.distributed.device_mesh import DeviceMesh

from autopart.degrees import Axis, Degrees, GroupOptions, MeshError

__all__ = ["Axis", "DeviceSpec", "Mesh", "MeshError", "PRESETS", "Topology", "device_spec"]

GiB = 1024**3
GB = 1e9


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """What one device can do. Bandwidths are bytes/s, latencies seconds."""

    name: str
    peak_flops: dict[str, float]  # dtype name ("fp32", "tf32", "bf16", "fp16") -> FLOP/s
    memory_bytes: int
    memory_bandwidth: float
    intra_node_bandwidth: float  # to a peer in the same node, one direction
    inter_node_bandwidth: float  # this device's share of the node's NICs, one direction
    intra_node_latency: float
    inter_node_latency: float
    kernel_launch_s: float  # the floor for one kernel or operator dispatch
    # One device's link to host memory, per direction (ZeRO offload's transfers): PCIe
    # 4.0 x16 moves about 25 GB/s, 5.0 x16 about 50 GB/s (PCI-SIG's 16 and 32 GT/s per
    # lane, less encoding and protocol overhead). And its share of the host's memory
    # bandwidth, which an optimizer step on the host is bound by (a dual-socket host's
    # eight DDR4/DDR5 channels per socket, about 400 GB/s, shared by 8 devices).
    host_bandwidth: float = 25e9
    host_memory_bandwidth: float = 50e9
    matmul_efficiency: float = 0.75  # achievable fraction of peak on large matmuls
    # The smallest matmul dim at which half of that efficiency is reached (cost_models.compute).
    matmul_half_dim: float = 64.0
    # Streaming multiprocessors of a GPU: set, contractions are priced by shape, their
    # tiles and waves over the SMs (cost_models.gemm), and matmul_efficiency is the
    # fraction of peak a tile's main loop reaches; 0: the saturating curve above.
    sm_count: int = 0
    # Fused (flash) attention's best fraction of peak, for the shape model (cost_models.gemm).
    attention_efficiency: float = 0.0
    # Measured collective costs from `autopart calibrate`: {op: {"alpha": s, "beta": s/byte}}.
    collectives: dict[str, dict[str, float]] = field(default_factory=dict)
    # Measured on a CPU by `autopart calibrate`: what one ZeRO-3 bucket's collectives
    # (gathered in forward and in backward, reduce-scattered) add to a step, {"alpha": s
    # per ring step, "beta": s per byte of the bucket sent}; empty where not measured.
    zero3_bucket: dict[str, float] = field(default_factory=dict)
    # Measured by `autopart calibrate`: each of a linear layer's three products per
    # dtype, {dtype: {"forward" | "grad_input" | "grad_weight": {"peak": FLOP/s,
    # "half_dim": n½}}}, whose operand layouts a CPU may run at very different rates
    # (`cost_models.compute`); empty: every product on the `peak_flops` curve.
    matmul_products: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    # Measured on a CPU by `autopart calibrate`: fused attention per dtype, {dtype:
    # {"full" | "causal": {"forward" | "backward": {"flop_s": s per FLOP, "row_s": s per
    # query row of a head}}}}; empty: attention on the `peak_flops` curve.
    attention_rates: dict[str, dict[str, dict[str, dict[str, float]]]] = field(default_factory=dict)
    # Measured evaluations/s of transcendental functions ("exp", "tanh", ...) from
    # `autopart calibrate`; absent, they are priced by memory traffic alone.
    function_rates: dict[str, float] = field(default_factory=dict)
    # Measured seconds of an Adam step per parameter tensor beyond its memory traffic;
    # None: `cost_models.compute.ADAM_OPERATORS_PER_TENSOR` operator floors.
    optimizer_tensor_s: float | None = None
    # Measured / modeled compute time of a reference transformer layer (`autopart
    # calibrate`); the compute model multiplies its operator times by it.
    compute_scale: float = 1.0
    # How `autopart calibrate` measured the profile: the host's load averages before and
    # after ("load_before", "load_after"), and its warnings ("warnings": measurements
    # that did not settle, rates outside plausible ranges). Empty for a preset.
    calibration: dict[str, Any] = field(default_factory=dict)

    def flops_for(self, dtype: torch.dtype | str) -> float:
        key = dtype if isinstance(dtype, str) else DTYPE_NAMES.get(dtype, "fp32")
        return self.peak_flops.get(key, self.peak_flops["fp32"])

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DeviceSpec:
        return cls(**data)


DTYPE_NAMES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float64: "fp64",
}

# Public data-sheet figures, one direction of each link per device, dense math:
#   A100 SXM4 80GB: 108 SMs; 19.5 TF fp32, 156 TF tf32, 312 TF bf16/fp16; 2.039 TB/s
#     HBM2e; NVLink3 600 GB/s bidirectional; one 200 Gb/s HDR NIC per GPU (DGX A100).
#   H100 SXM5 80GB: 132 SMs; 67 TF fp32, 495 TF tf32, 989 TF bf16/fp16; 3.35 TB/s HBM3;
#     NVLink4 900 GB/s bidirectional; one 400 Gb/s NDR NIC per GPU (DGX H100).
#   H200 SXM 141GB: the H100's GH100 chip, clocks and links with 141 GB of HBM3e at
#     4.8 TB/s (DGX H200: one 400 Gb/s NDR NIC per GPU).
# Achieved GEMM efficiency: the best measured bf16 matmul rate ("maximum achievable
# matmul FLOPS", Bekman, ml-engineering, compute/accelerator, measured with PyTorch):
# A100 SXM 267.9 TF (85.9%) at 6912×16384×2048 (CUDA 12.1), H100 SXM 792.1 TF (80.1%)
# at 6144×17920×2816 (CUDA 12.1). matmul_efficiency is the main loop's fraction that
# gives those rates at those shapes under cost_models.gemm's tiles and waves: A100
# 0.859 / (2048/2112, k₀; 32 full waves) = 0.886; H100 0.801 / (2816/2880; 25.45 of 26
# waves) = 0.837; the H200 is taken as the H100 (the same chip and power), which
# measurement bears out: benchmarks/preset_vs_gpu.py's 20 GEMMs of 4096 tokens or more
# took a median 1.02x their time on an H100, its attention at 4096-8192 keys 0.95-1.02x.
# Attention efficiency: fused attention forward and backward at head dim 128 and 2048-4096
# keys, about 61% of peak on A100 (FlashAttention-2, Dao 2023) and 50% on H100 with
# PyTorch 2.11's kernels (measured for cost_models.compute), over that shape's factors
# in cost_models.gemm (0.8 · 0.845).
#   A10 PCIe 24GB: 31.2 TF fp32, 62.5 TF tf32, 125 TF bf16/fp16; 600 GB/s GDDR6; no
#     NVLink: peers and host over PCIe 4.0 x16 (about 25 GB/s a direction); a node of 8
#     with one 100 Gb/s NIC (AWS g5.48xlarge: 8 A10G), 1.5 GB/s per device. Its GEMM
#     efficiency is the DeviceSpec default, not a measurement: calibrate on the machine.
# cpu: a modest two-core x86 host running Gloo over loopback; calibrate for real figures.
_H100_LINKS: dict[str, Any] = dict(
    intra_node_bandwidth=450 * GB,
    inter_node_bandwidth=50 * GB,
    intra_node_latency=6e-6,
    inter_node_latency=12e-6,
    kernel_launch_s=4e-6,
)
PRESETS: dict[str, DeviceSpec] = {
    "a100-80g": DeviceSpec(
        name="a100-80g",
        peak_flops={"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
        memory_bytes=80 * GiB,
        memory_bandwidth=2.039e12,
        intra_node_bandwidth=300 * GB,
        inter_node_bandwidth=25 * GB,
        intra_node_latency=8e-6,
        inter_node_latency=15e-6,
        kernel_launch_s=5e-6,
        matmul_efficiency=0.886,
        sm_count=108,
        attention_efficiency=0.90,
    ),
    "h100-80g": DeviceSpec(
        name="h100-80g",
        peak_flops={"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12},
        memory_bytes=80 * GiB,
        memory_bandwidth=3.35e12,
        matmul_efficiency=0.837,
        sm_count=132,
        attention_efficiency=0.74,
        host_bandwidth=50 * GB,
        **_H100_LINKS,
    ),
    "h200": DeviceSpec(
        name="h200",
        peak_flops={"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12},
        memory_bytes=141 * 10**9,  # 141 GB, decimal
        memory_bandwidth=4.8e12,
        matmul_efficiency=0.837,
        sm_count=132,
        attention_efficiency=0.74,
        host_bandwidth=50 * GB,
        **_H100_LINKS,
    ),
    "a10-24g": DeviceSpec(
        name="a10-24g",
        peak_flops={"fp32": 31.2e12, "tf32": 62.5e12, "bf16": 125e12, "fp16": 125e12},
        memory_bytes=24 * GiB,
        memory_bandwidth=600 * GB,
        intra_node_bandwidth=25 * GB,
        inter_node_bandwidth=1.5 * GB,
        intra_node_latency=10e-6,
        inter_node_latency=30e-6,
        kernel_launch_s=5e-6,
    ),
    "cpu": DeviceSpec(
        name="cpu",
        peak_flops={"fp32": 50e9, "bf16": 20e9, "fp16": 10e9},
        memory_bytes=24 * GiB,
        memory_bandwidth=10 * GB,
        intra_node_bandwidth=2 * GB,
        inter_node_bandwidth=1 * GB,
        intra_node_latency=50e-6,
        inter_node_latency=100e-6,
        kernel_launch_s=10e-6,
        matmul_efficiency=0.6,
        host_bandwidth=10 * GB,  # "host" is the same memory
        host_memory_bandwidth=10 * GB,
    ),
}


def device_spec(device: str | os.PathLike | DeviceSpec) -> DeviceSpec:
    """A preset name, a device profile JSON path, or a `DeviceSpec` as it is."""
    if isinstance(device, DeviceSpec):
        return device
    if str(device) in PRESETS:
        return PRESETS[str(device)]
    path = Path(device)
    if path.suffix == ".json" and path.exists():
        return DeviceSpec.from_json(json.loads(path.read_text()))
    raise MeshError(
        f"unknown device {str(device)!r}: use one of {sorted(PRESETS)} "
        "or the path of a profile written by `autopart calibrate`"
    )


@dataclass(frozen=True, slots=True)
class Level:
    """One level of the network: `size` peers share links of this bandwidth and latency."""

    name: str
    size: int
    bandwidth: float
    latency: float


@dataclass(frozen=True, slots=True)
class Topology:
    """Levels from the innermost (inside a node) outwards (between nodes)."""

    levels: tuple[Level, ...]

    def level_of_span(self, span: int) -> Level:
        """The slowest level crossed by a group of `span` consecutive ranks."""
        covered = 1
        for level in self.levels:
            covered *= level.size
            if span <= covered:
                return level
        return self.levels[-1]


@dataclass(frozen=True, slots=True)
class Mesh:
    """`nodes × per_node` identical devices. `backend` is set only for a running world."""

    device: DeviceSpec
    nodes: int
    per_node: int
    backend: str | None = None

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.per_node < 1:
            raise MeshError(f"a mesh needs at least one device, got {self.nodes}×{self.per_node}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node

    @property
    def topology(self) -> Topology:
        d = self.device
        return Topology(
            (
                Level("intra-node", self.per_node, d.intra_node_bandwidth, d.intra_node_latency),
                Level("inter-node", self.nodes, d.inter_node_bandwidth, d.inter_node_latency),
            )
        )

    @property
    def is_running(self) -> bool:
        return self.backend is not None

    def describe(self) -> str:
        where = f", {self.backend}" if self.backend else ""
        return f"{self.nodes}×{self.per_node} {self.device.name}{where}"

    @classmethod
    def cluster(
        cls, device: str | os.PathLike | DeviceSpec, nodes: int = 1, per_node: int = 8
    ) -> Mesh:
        """A mesh for planning only: nothing is initialized."""
        return cls(device_spec(device), nodes, per_node)

    @classmethod
    def local(
        cls,
        device: str | os.PathLike | DeviceSpec | None = None,
        timeout: timedelta | None = None,
    ) -> Mesh:
        """The running torch.distributed world (initialized from torchrun's variables if
        needed, with `timeout` for its collectives): NCCL on CUDA, Gloo on CPU. A single
        process with no launcher is a world of 1."""
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if not dist.is_initialized():
            if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
                if backend == "nccl":
                    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
                dist.init_process_group(backend, timeout=timeout, **_launcher_store(timeout))
            else:
                dist.init_process_group(
                    backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
                )
        backend = dist.get_backend()
        world = dist.get_world_size()
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if world % per_node:
            per_node = world
        if device is None:
            device = gpu_preset() if backend == "nccl" else "cpu"
        return cls(device_spec(device), world // per_node, per_node, backend=backend)

    def device_mesh(self, degrees: Degrees, timeout: timedelta | None = None) -> DeviceMesh:
        """The named torch DeviceMesh of `degrees` (axes in mesh order) for this world,
        its process groups failing any collective that waits longer than `timeout`."""
        self.check_covered(degrees)
        self.check_running()
        device = "cuda" if self.backend == "nccl" else "cpu"
        return degrees.device_mesh(device, self.group_options(timeout))

    def group_options(self, timeout: timedelta | None) -> GroupOptions | None:
        """The backend and options that give a new process group `timeout`."""
        if timeout is None:
            return None
        backend = self.backend or "gloo"
        if backend == "nccl":  # NCCL's groups take its own options class
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout  # the field DeviceMesh reads for a group's timeout
            return backend, options
        return backend, Backend.Options(backend, timeout)

    def check_covered(self, degrees: Degrees) -> None:
        """Fail clearly unless `degrees` multiply to this mesh's devices."""
        degrees.check_covers(self.world_size, self.describe())

    def check_running(self) -> None:
        """Fail clearly when this mesh is not the world the process is running in."""
        if not self.is_running:
            raise MeshError(
                f"mesh {self.describe()} is for planning only; use autopart.Mesh.local() "
                "inside a torch.distributed job (for example under torchrun)"
            )
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world != self.world_size:
            raise MeshError(
                f"the mesh has {self.world_size} devices ({self.describe()}) but this "
                f"torch.distributed world has {world} processes: launch {self.world_size} "
                f"processes or plan for a mesh of {world}"
            )


def _launcher_store(timeout: timedelta | None) -> dict[str, Any]:
    """The store for the world's process groups, where torchrun shares its own.

    torchrun's agent keeps one store for the whole job, and a relaunch (--max-restarts)
    finds there the keys its previous attempt wrote: a process group could then read a
    dead peer's address and fail to connect, or wait. Each attempt gets keys of its own
    under the restart count (the same on every rank: torchrun relaunches every worker)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}  # init_process_group reads the launcher's variables itself
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    wait = timeout or timedelta(minutes=5)
    shared = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=wait
    )
    return {
        "store": dist.PrefixStore(f"autopart/attempt_{attempt}/", shared),
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
    }


def gpu_preset(device: torch.device | int | None = None) -> str:
    """The preset nearest this process's GPU (the H100's for a GPU it does not know)."""
    name = torch.cuda.get_device_name(device).lower()
    return "a100-80g" if "a100" in name else "h200" if "h200" in name else "h100-80g"
