"""How close to peak a GPU runs a matrix multiply or a fused attention, by shape.

Matrix multiplies (NVIDIA, "Matrix Multiplication Background User's Guide", Deep
Learning Performance documentation: tile and wave quantization; Anthony et al., "The
Case for Co-Designing Model Architectures with Hardware", 2024). A GEMM kernel cuts the
m×n output into tiles of Tm×Tn; each tile is computed by one SM, walking k in steps. The
SMs take the tiles in waves, so

    tiles = ⌈m/Tm⌉ · ⌈n/Tn⌉ · s        (s: split-K, k cut into s parts over idle SMs)
    waves = ⌈tiles / SMs⌉
    time  = waves · 2·Tm·Tn·(k/s + k₀) / (peak / SMs · e_max · e_tile)

A partial tile costs a whole one (tile quantization: a dim one past a multiple of the
tile pays a new row or column of tiles), and a last wave that fills few SMs costs a
whole wave (wave quantization). k₀ is each tile's prologue and epilogue (filling the
pipeline of loads, writing the tile) in units of k. Split-K (s > 1) fills idle SMs
when the output has few tiles, and adds the reduction of its partial sums: s fp32
copies of the output written and read, over the memory bandwidth. Every choice's time
grows with m, n and k, so the cheapest does too. The kernel is the cheapest of
`TILES` and `SPLITS`, as cuBLAS's heuristics choose among tile shapes; smaller tiles
reuse less of what they load and reach less of the peak (`TILES`' factors). e_max is
the device's (`DeviceSpec.matmul_efficiency`), set so that the model gives the best
measured rate at the shape where it was measured (`autopart.mesh` presets).

    efficiency(m, n, k) = 2·m·n·k / (peak · time)

The roofline's memory side (a GEMM too small to be compute-bound) is the compute
model's: it takes the larger of this time and the bytes over the memory bandwidth.

Fused attention (Dao, "FlashAttention-2", 2023): each of B·H query blocks of `Q_TILE`
rows streams every key once. Its rate grows with the head dim E (more arithmetic per
byte of Q, K, V moved through shared memory) and with the key length S (each query
block's fixed cost, loading Q and rescaling and writing its output, spread over more
keys):

    efficiency(S, E) = attention_efficiency · E/(E + E½) · S/(S + S₀)

with waves of query blocks over the SMs as above. E½ = 32 gives head dim 64 about 0.83
of head dim 128's rate (FlashAttention-2 on A100); S₀ = 512 gives 1024 and 512 keys
1.3× and 1.7× the time per FLOP of 2048-4096 (measured on an H100 with PyTorch's
kernels: 1.3× and 1.8×). Scores are counted in full (FLOPs as published runs count
them); a causal kernel runs query block i over the (i + 1)·Q_TILE keys up to its
diagonal, so the blocks' cost Σ (keys_i + S₀) gives causal attention

    causal / full = (S·(n + 1)/(2n) + S₀) / (S + S₀),    n = ⌈L/Q_TILE⌉ (L = S)

of the full kernel's time: 0.54 at 8192 keys, 0.57 at 4096, 0.63 at 2048, 0.71 at
1024 (measured on an H200, `benchmarks/preset_vs_gpu.py`: 0.53, 0.66, 0.72-0.81, 0.70).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Output tiles (rows, columns) and the fraction of the large tile's rate each reaches.
TILES: tuple[tuple[int, int, float], ...] = (
    (256, 128, 1.0),
    (128, 256, 1.0),
    (128, 128, 0.9),
    (64, 64, 0.6),
)
SPLITS = (1, 2, 4, 8, 16)  # split-K factors
PARTIAL_BYTES = 4  # split-K's partial sums are fp32
K_OVERHEAD = 64  # k₀: a tile's prologue and epilogue, in units of k
# cuBLAS's tensor-core kernels read rows aligned to 16 bytes: a product whose operands'
# rows are not (a linear layer's input or output features not a multiple of 8 at 2
# bytes an element) falls back to slower kernels. Measured on an H100 (PyTorch 2.11,
# cuBLAS for CUDA 13, benchmarks/preset_vs_gpu.py): a 4096 → 4097 or 4097 → 4096
# linear layer's forward and backward take 5.3× the time of 4096 → 4096 at 4096
# tokens; 4097 tokens cost nothing more.
ALIGNMENT = 8
UNALIGNED_SLOWDOWN = 5.3
Q_TILE = 128  # query rows per attention block
HEAD_HALF = 32.0  # E½
KEYS_OVERHEAD = 512.0  # S₀


@dataclass(frozen=True, slots=True)
class GpuCores:
    """What the shape model needs of a GPU: its SMs, the peak of the dtype, and the
    fractions of that peak GEMMs and fused attention reach at best."""

    sms: int
    peak: float  # FLOP/s of the dtype
    matmul_efficiency: float  # e_max
    attention_efficiency: float
    memory_bandwidth: float  # bytes/s, for split-K's reduction

    def gemm_seconds(self, m: float, n: float, k: float) -> float:
        """The compute time of an m×k by k×n product: the cheapest tile and split."""
        return min(
            self._tiled(m, n, k, tile_m, tile_n, factor, split)
            for tile_m, tile_n, factor in TILES
            for split in SPLITS
        )

    def gemm_efficiency(self, m: float, n: float, k: float) -> float:
        """2·m·n·k / (peak · time): the fraction of peak this shape reaches."""
        if min(m, n, k) <= 0:
            return self.matmul_efficiency
        return 2 * m * n * k / (self.peak * self.gemm_seconds(m, n, k))

    def _tiled(
        self, m: float, n: float, k: float, tile_m: int, tile_n: int, factor: float, split: int
    ) -> float:
        tiles = math.ceil(m / tile_m) * math.ceil(n / tile_n) * split
        waves = math.ceil(tiles / self.sms)
        per_sm = self.peak / self.sms * self.matmul_efficiency * factor
        main = waves * 2 * tile_m * tile_n * (k / split + K_OVERHEAD) / per_sm
        if split == 1:
            return main
        return main + 2 * split * m * n * PARTIAL_BYTES / self.memory_bandwidth

    def alignment_factor(self, n: float, k: float) -> float:
        """How much longer a product of n output and k input features takes than its
        aligned shape (`UNALIGNED_SLOWDOWN` where either is not a multiple of
        `ALIGNMENT`), in forward and backward alike: every product of a linear layer
        reads rows of n or k elements. k is taken whole: the compute model's k counts a
        bias as half a feature (its m·n additions among the 2·m·n·k FLOPs)."""
        aligned = n % ALIGNMENT == 0 and math.floor(k) % ALIGNMENT == 0
        return 1.0 if aligned else UNALIGNED_SLOWDOWN

    def attention_seconds(
        self, flops: float, queries: float, keys: float, head: float, causal: bool = False
    ) -> float:
        """Fused attention of `flops` (2·B·H·L·S·(E + Ev), counted in full) over L =
        `queries` rows of S = `keys` keys at head dim E = `head`: B·H·⌈L/Q_TILE⌉ blocks
        in waves over the SMs, each at `attention_rate`; `causal`, over the key blocks
        up to each query block's diagonal (`causal_fraction`)."""
        if flops <= 0:
            return 0.0
        heads = flops / (4 * queries * keys * head)  # B·H
        blocks = heads * math.ceil(queries / Q_TILE)
        waves = math.ceil(blocks / self.sms)
        filled = blocks / (waves * self.sms)
        full = flops / (self.peak * self.attention_rate(keys, head) * filled)
        return full * causal_fraction(queries, keys) if causal else full

    def attention_rate(self, keys: float, head: float) -> float:
        """attention_efficiency · E/(E + E½) · S/(S + S₀)."""
        return self.attention_efficiency * head / (head + HEAD_HALF) * keys / (keys + KEYS_OVERHEAD)


def causal_fraction(queries: float, keys: float) -> float:
    """A causal fused kernel's time over the full one's for L = `queries` rows and S =
    `keys` keys (the mask's top-left diagonal, as `is_causal` has it): query block i
    streams min(S, (i + 1)·Q_TILE) keys, each block paying S₀ besides."""
    n = math.ceil(queries / Q_TILE)
    within = min(n, math.ceil(keys / Q_TILE))  # blocks whose diagonal lies inside S
    visited = Q_TILE * within * (within + 1) / 2 + (n - within) * keys
    return min(1.0, (visited + n * KEYS_OVERHEAD) / (n * (keys + KEYS_OVERHEAD)))
