"""The GPU shape model: GEMM efficiency by tiles and waves, fused attention by keys and
head dim, and the presets' calibration to measured rates."""

from __future__ import annotations

import itertools

import pytest

from autopart.cost_models.compute import ComputeModel
from autopart.cost_models.gemm import TILES, causal_fraction
from autopart.cost_models.work import ATTENTION, NodeWork
from autopart.mesh import PRESETS

A100 = ComputeModel(PRESETS["a100-80g"], "bf16-mixed")
H100 = ComputeModel(PRESETS["h100-80g"], "bf16-mixed")
H200 = ComputeModel(PRESETS["h200"], "bf16-mixed")


@pytest.mark.parametrize(
    "model, shape, measured",
    [
        # Bekman, ml-engineering: maximum achievable bf16 matmul FLOPS and its shape.
        (A100, (6912, 16384, 2048), 267.9 / 312),
        (H100, (6144, 17920, 2816), 792.1 / 989),
        (H200, (6144, 17920, 2816), 792.1 / 989),
    ],
)
def test_presets_reach_the_best_measured_rate_at_its_shape(model, shape, measured):
    assert model.efficiency(*shape) == pytest.approx(measured, rel=0.01)


@pytest.mark.parametrize("model", [A100, H100, H200])
def test_large_gemms_run_near_the_presets_peak_and_never_above_it(model):
    cap = model.device.matmul_efficiency
    for n in (8192, 12288, 16384):
        assert 0.93 * cap <= model.efficiency(n, n, n) <= cap


def test_a_dim_one_past_a_tile_pays_a_new_row_of_tiles():
    # 6912 × 8192 in 256 × 128 tiles is 27 × 64 = 1728 tiles, 16 full waves of 108 SMs;
    # one more column of n starts a 17th wave, and the sawtooth recovers as the new
    # column of tiles fills.
    aligned = A100.efficiency(6912, 8192, 4096)
    past = A100.efficiency(6912, 8193, 4096)
    refilled = A100.efficiency(6912, 8192 + 128 * 4, 4096)
    assert past < 0.96 * aligned
    assert refilled > past
    # The same step in m.
    assert A100.efficiency(6913, 8192, 4096) < 0.96 * aligned


def test_a_tile_past_a_full_wave_costs_a_whole_wave():
    sms = A100.device.sm_count
    one_wave = A100.efficiency(256, 128 * sms, 1024)
    a_tile_more = A100.efficiency(256, 128 * (sms + 1), 1024)
    two_waves = A100.efficiency(256, 128 * 2 * sms, 1024)
    assert a_tile_more < 0.7 * one_wave
    assert two_waves == pytest.approx(one_wave, rel=0.02)


def test_time_grows_with_every_dim():
    cores = A100.cores
    assert cores is not None
    sizes = (1, 100, 127, 128, 129, 255, 256, 1000, 2047, 2048, 2049, 8192)
    for m, n, k in itertools.product(sizes, repeat=3):
        t = cores.gemm_seconds(m, n, k)
        assert cores.gemm_seconds(m + 1, n, k) >= t
        assert cores.gemm_seconds(m, n + 1, k) >= t
        assert cores.gemm_seconds(m, n, k + 64) >= t


def test_aligned_cubes_rise_toward_the_peak():
    rates = [A100.efficiency(n, n, n) for n in (256, 512, 1024, 2048, 4096, 8192)]
    assert rates == sorted(rates)
    assert rates[0] < 0.2 < 0.8 < rates[-1]


def test_smaller_tiles_are_slower_per_tile():
    factors = {(m, n): f for m, n, f in TILES}
    assert factors[(256, 128)] == max(factors.values())
    assert factors[(64, 64)] < factors[(128, 128)] < factors[(256, 128)]


def test_backward_prices_its_own_two_products():
    # A skinny product (few rows): its input gradient (m × k) is as skinny, its weight
    # gradient (k × n over m) is a square output with a short contraction.
    m, n, k = 256, 8192, 8192
    work = NodeWork("matmul", 2.0 * m * n * k, shape=(m, n, k))
    backward = A100.contraction_math(work, backward=True)
    cores = A100.cores
    assert cores is not None
    assert backward == pytest.approx(cores.gemm_seconds(m, k, n) + cores.gemm_seconds(k, n, m))
    assert backward != pytest.approx(2 * A100.contraction_math(work))


def test_attention_runs_faster_per_flop_at_longer_keys_and_wider_heads():
    def rate(model: ComputeModel, seq: int, head: int, heads: int = 32) -> float:
        flops = 4.0 * heads * seq * seq * head
        work = NodeWork(ATTENTION, flops, shape=(seq, seq, head))
        return flops / model.contraction_math(work) / model.contraction_peak

    assert rate(H100, 512, 128) < rate(H100, 2048, 128) < rate(H100, 8192, 128)
    assert rate(H100, 2048, 64) < rate(H100, 2048, 128)
    # Head dim 128 at 2048-4096 keys, as the presets were set from: about half of the
    # H100's peak, about 61% of the A100's (heads that fill whole waves of query blocks).
    h100 = (rate(H100, 2048, 128, heads=33) + rate(H100, 4096, 128, heads=33)) / 2
    a100 = (rate(A100, 2048, 128, heads=27) + rate(A100, 4096, 128, heads=27)) / 2
    assert h100 == pytest.approx(0.50, abs=0.01)
    assert a100 == pytest.approx(0.61, abs=0.01)
    # Few query blocks leave SMs idle: one head of 2048 rows fills 16 of 132.
    assert rate(H100, 2048, 128, heads=1) < 0.2 * rate(H100, 2048, 128)


def test_unaligned_features_slow_every_product_of_the_layer_but_tokens_do_not():
    """A linear layer whose input or output features are not a multiple of 8 (16 bytes
    of bf16) leaves cuBLAS's tensor-core kernels: 5.3× the time, forward and backward,
    as measured on an H100 (benchmarks/data/h100_shapes.json)."""
    from autopart.cost_models.gemm import UNALIGNED_SLOWDOWN

    def seconds(m, n, k):
        work = NodeWork("linear", 2.0 * m * n * k, shape=(m, n, k))
        return H100.contraction_math(work) + H100.contraction_math(work, backward=True)

    aligned = seconds(4096, 4096, 4096)
    for unaligned in ((4096, 4097, 4096), (4096, 4096, 4097)):
        assert seconds(*unaligned) == pytest.approx(UNALIGNED_SLOWDOWN * aligned, rel=0.05)
    assert seconds(4097, 4096, 4096) < 1.1 * aligned


@pytest.mark.parametrize(
    "seq, measured",  # an H200's causal over full fused attention (preset_vs_gpu.py)
    [(1024, 0.695), (4096, 0.664), (8192, 0.534)],
)
def test_causal_attention_pays_for_the_key_blocks_up_to_each_diagonal(seq, measured):
    def seconds(causal: bool) -> float:
        flops = 4.0 * 32 * seq * seq * 128
        work = NodeWork(ATTENTION, flops, shape=(seq, seq, 128), causal=causal)
        return H200.contraction_math(work, backward=True)

    ratio = seconds(True) / seconds(False)
    assert ratio == pytest.approx(causal_fraction(seq, seq))
    assert ratio == pytest.approx(measured, abs=0.1)
    # Half the blocks and the diagonal's: toward one half at long sequences, and no
    # saving for a query block shorter than a tile; queries past the keys see them all.
    assert causal_fraction(131072, 131072) == pytest.approx(0.5, abs=0.005)
    assert causal_fraction(100, 100) == 1.0
    assert causal_fraction(1024, 512) > causal_fraction(512, 512)


def test_a_decoders_attention_is_priced_causal_and_an_unmasked_one_is_not():
    """A Hugging Face decoder hands attention a causal mask built from shapes alone;
    attention called without a mask or flag is not causal."""
    import torch

    from autopart.capture import capture
    from autopart.cost_models.work import node_work
    from autopart.passes import analyze
    from tests.models import tiny_llama

    class Unmasked(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    ids = torch.zeros(2, 16, dtype=torch.long)
    qkv = tuple(torch.randn(1, 2, 16, 8) for _ in range(3))
    for module, inputs, causal in ((tiny_llama(), (ids,), True), (Unmasked(), qkv, False)):
        captured = capture(module, inputs)
        gm = analyze(captured.gm, captured.context())
        works = [node_work(n, gm, captured.dim_sizes, {}) for n in gm.graph.nodes]
        attention = [w for w in works if w.kind == ATTENTION]
        assert attention and all(w.causal == causal for w in attention)
