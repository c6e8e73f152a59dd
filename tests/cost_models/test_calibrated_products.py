"""A calibrated profile times a linear layer's three products per dtype, each in its own
operand layout, and fused attention per dtype; the compute model prices each product of
a matrix product on the curve of the layout it runs in. Fake timings with known rates,
no measured time asserted."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import pytest
import torch

import autopart.calibrate as cal
from autopart.capture import BATCH, capture
from autopart.cost_models.compute import LAYOUT_PRODUCTS, LINEAR_PRODUCTS, ComputeModel
from autopart.cost_models.work import ATTENTION, MATMUL, NodeWork, node_work
from autopart.mesh import PRESETS, device_spec
from autopart.ops.aten import op_name
from autopart.passes import analyze

# Known rates per dtype and product: a CPU without bf16 instructions, whose bf16 product
# with both operands as stored (a linear's input gradient) is the slowest.
PEAKS = {
    "fp32": {"forward": 60e9, "grad_input": 50e9, "grad_weight": 55e9},
    "bf16": {"forward": 10e9, "grad_input": 1e9, "grad_weight": 20e9},
}
HALF_DIM = 32.0
CALL_S = 2e-6


def _fake_product_times(sizes, dtype, product, device, repeats):
    """The compute model's curve at the known rate of `product` in `dtype`."""
    peak = PEAKS[dtype][product]
    return {1: CALL_S, **{n: CALL_S + 2 * n**2 * (n + HALF_DIM) / peak for n in sizes}}


def _fake_calibration(monkeypatch, tmp_path, attention: dict | None = None):
    monkeypatch.setattr(cal, "_operator_floor", lambda device, repeats: 5e-6)
    monkeypatch.setattr(cal, "_product_times", _fake_product_times)
    monkeypatch.setattr(cal, "_attention_fits", lambda *args: attention or {})
    monkeypatch.setattr(cal, "_copy_bandwidth", lambda nbytes, device, repeats: 1e10)
    monkeypatch.setattr(cal, "_function_rates", lambda device, repeats: {"exp": 1e9})
    monkeypatch.setattr(cal, "_optimizer_per_tensor", lambda device, repeats: 3e-5)
    monkeypatch.setattr(cal, "_compute_scale", lambda spec, device, repeats: 1.0)
    path = tmp_path / "profile.json"
    cal.calibrate(path, sizes=(128, 256, 512), dtypes=("fp32", "bf16"))
    return device_spec(path)


def test_the_profile_holds_a_linear_layers_three_products_per_dtype(monkeypatch, tmp_path):
    spec = _fake_calibration(monkeypatch, tmp_path)
    assert set(spec.matmul_products) == {"fp32", "bf16"}
    for dtype, fits in spec.matmul_products.items():
        assert tuple(fits) == LINEAR_PRODUCTS
        for product, fit in fits.items():
            assert fit["peak"] == pytest.approx(PEAKS[dtype][product], rel=1e-6)
            assert fit["half_dim"] == pytest.approx(HALF_DIM, rel=1e-6)
    # Both operands as stored, the one layout calibrated before: what prices the other
    # contractions.
    assert spec.peak_flops["bf16"] == pytest.approx(PEAKS["bf16"]["grad_input"], rel=1e-6)
    assert spec.matmul_half_dim == pytest.approx(HALF_DIM, rel=1e-6)


def test_a_cpu_calibrates_bf16_by_default_and_times_each_products_layout(monkeypatch):
    timed = []

    def median_times(fns, device, repeats, what=""):
        timed.append(what)
        return {key: 1e-3 for key in fns}

    monkeypatch.setattr(cal, "_median_times", median_times)
    for dtype in ("fp32", "bf16"):
        for product in LINEAR_PRODUCTS:
            cal._product_times((4,), dtype, product, torch.device("cpu"), 1)
    assert timed == [f"matmul {d} {p}" for d in ("fp32", "bf16") for p in LINEAR_PRODUCTS]
    x = torch.arange(4.0).reshape(2, 2)  # the calls compute what a linear computes
    forward = cal._product_call(2, torch.float32, "forward", torch.device("cpu"))
    assert forward().shape == x.shape  # type: ignore[attr-defined]
    assert cal._sizes_for((128, 1024, 2048), "bf16", torch.device("cpu")) == (128, 1024)
    assert cal._sizes_for((128, 1024, 2048), "fp32", torch.device("cpu")) == (128, 1024, 2048)


def _linear_work(m: float, n: float, k: float, layout: str | None) -> NodeWork:
    return NodeWork(MATMUL, 2.0 * m * n * k, shape=(m, n, k), layout=layout, low_precision=True)


def _products_spec():
    fits = {
        dtype: {p: {"peak": peak, "half_dim": 0.0} for p, peak in by.items()}
        for dtype, by in PEAKS.items()
    }
    return replace(PRESETS["cpu"], matmul_products=fits, matmul_efficiency=1.0)


def test_each_product_of_a_linear_is_priced_at_its_layouts_rate():
    spec = _products_spec()
    model = ComputeModel(spec, "bf16-params", half_dim=0.0)
    work = _linear_work(1024, 256, 128, "nt")  # x @ Wᵀ
    rates = PEAKS["bf16"]
    assert model.contraction_math(work) == pytest.approx(work.flops / rates["forward"])
    assert model.contraction_math(work, backward=True) == pytest.approx(
        work.flops / rates["grad_input"] + work.flops / rates["grad_weight"]
    )
    # Both operands as stored (GPT-2's Conv1D, x @ W with W in × out): the forward runs as
    # a linear's input gradient, its input's gradient g @ Wᵀ as a linear's forward.
    plain = _linear_work(1024, 256, 128, "nn")
    assert model.contraction_math(plain) == pytest.approx(plain.flops / rates["grad_input"])
    assert model.contraction_math(plain, backward=True) == pytest.approx(
        plain.flops / rates["forward"] + plain.flops / rates["grad_weight"]
    )
    assert LAYOUT_PRODUCTS["nt"] == LINEAR_PRODUCTS
    # fp32 reads its own curves.
    fp32 = ComputeModel(spec, "fp32", half_dim=0.0)
    assert fp32.contraction_math(work) == pytest.approx(work.flops / PEAKS["fp32"]["forward"])


def test_without_the_products_a_contraction_stays_on_the_one_curve():
    # An old profile, a preset, or a contraction that is no matrix product: the peak_flops
    # curve, backward twice the forward.
    spec = replace(PRESETS["cpu"], peak_flops={"fp32": 50e9, "bf16": 2e9})
    model = ComputeModel(spec, "bf16-params", half_dim=0.0)
    work = _linear_work(1024, 256, 128, "nt")
    one_curve = work.flops / (2e9 * spec.matmul_efficiency)
    assert model.contraction_math(work) == pytest.approx(one_curve)
    assert model.contraction_math(work, backward=True) == pytest.approx(2 * one_curve)
    calibrated = ComputeModel(replace(_products_spec(), peak_flops=spec.peak_flops), "bf16-params")
    conv = _linear_work(1024, 256, 128, None)
    assert calibrated.contraction_math(conv) == pytest.approx(
        conv.flops / (2e9 * calibrated.efficiency(1024, 256, 128))
    )


def test_a_gpu_preset_keeps_its_figures():
    for name in ("a100-80g", "h100-80g", "h200", "a10-24g", "cpu"):
        assert PRESETS[name].matmul_products == {} and PRESETS[name].attention_rates == {}
    h100 = PRESETS["h100-80g"]
    measured = replace(h100, matmul_products=_products_spec().matmul_products)
    work = _linear_work(8192, 8192, 8192, "nt")
    # The shape model prices a preset's contractions, whatever a profile measured.
    assert ComputeModel(measured, "bf16-params").contraction_math(work) == pytest.approx(
        ComputeModel(h100, "bf16-params").contraction_math(work)
    )


def test_a_profile_written_before_the_products_still_loads(tmp_path):
    old = asdict(PRESETS["cpu"])
    del old["matmul_products"], old["attention_rates"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    spec = device_spec(path)
    assert spec.matmul_products == {} and spec.attention_rates == {}
    assert ComputeModel(spec, "bf16-params").products == {}


def _analyzed(module: torch.nn.Module, x: torch.Tensor) -> tuple[torch.fx.GraphModule, dict]:
    captured = capture(module, (x,))
    analyze(captured.gm, captured.context())
    return captured.gm, {**captured.dim_sizes, BATCH: x.shape[0]}


class _Products(torch.nn.Module):
    """A linear layer, GPT-2's Conv1D (x @ W, W in × out) and a product of activations
    with a transposed one."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.conv1d = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.addmm(torch.zeros(8), self.linear(x), self.conv1d)
        return y @ x.transpose(0, 1)


def test_the_analysis_tells_a_products_layout():
    gm, dims = _analyzed(_Products(), torch.randn(4, 8))
    layouts = {
        op_name(n, gm): node_work(n, gm, dims, {}).layout
        for n in gm.graph.nodes
        if op_name(n, gm) in ("linear", "addmm", "mm", "matmul")
    }
    assert layouts["linear"] == "nt"
    assert layouts["addmm"] == "nn"
    (product,) = {k for k in layouts if k in ("mm", "matmul")}
    assert layouts[product] == "nt"


def _attention_work(batch: int, heads: int, length: int, head: int, causal: bool) -> NodeWork:
    flops = 4.0 * batch * heads * length * length * head
    evaluations = batch * heads * length * length
    return NodeWork(
        ATTENTION,
        flops,
        shape=(length, length, head),
        causal=causal,
        function="exp",
        evaluations=evaluations,
        evaluates_in_backward=True,
    )


def test_attention_is_priced_by_its_measured_rows_and_flops():
    fit = {
        "forward": {"flop_s": 1e-11, "row_s": 1e-7},
        "backward": {"flop_s": 3e-11, "row_s": 3e-6},
    }
    spec = replace(
        PRESETS["cpu"],
        attention_rates={"bf16": {"causal": fit, "full": fit}},
        function_rates={"exp": 1e8},
    )
    model = ComputeModel(spec, "bf16-params")
    work = _attention_work(16, 4, 64, 16, causal=True)
    rows = 16 * 4 * 64
    assert model.contraction_math(work) == pytest.approx(rows * 1e-7 + work.flops * 1e-11)
    assert model.contraction_math(work, backward=True) == pytest.approx(
        rows * 3e-6 + 2 * work.flops * 3e-11
    )
    assert model.function_time(work) == 0.0  # measured whole, exponentials included
    # fp32 has no measurement in this profile: the curve and the exponentials.
    assert ComputeModel(spec, "fp32").function_time(work) == pytest.approx(work.evaluations / 1e8)


def test_attention_fits_recover_known_rows_and_flops(monkeypatch):
    launch, per_flop, per_row = 5e-6, 2e-11, 3e-6

    def median_times(fns, device, repeats, what=""):
        times = {}
        for mask, direction, i in fns:
            batch, heads, length, head = cal.ATTENTION_SHAPES[i]
            rows = batch * heads * length
            flops = 4.0 * rows * length * head
            forward = launch + flops * per_flop / 4 + rows * per_row / 8
            backward = 2 * launch + 2 * flops * per_flop + rows * per_row
            times[(mask, direction, i)] = forward + (backward if direction == "both" else 0.0)
        return times

    monkeypatch.setattr(cal, "_median_times", median_times)
    monkeypatch.setattr(cal, "_attention_calls", lambda *args: (lambda: None, lambda: None))
    fits = cal._attention_fits("bf16", launch, torch.device("cpu"), 1)
    for mask in ("full", "causal"):
        assert fits[mask]["forward"] == pytest.approx(
            {"flop_s": per_flop / 4, "row_s": per_row / 8}, rel=1e-6
        )
        assert fits[mask]["backward"] == pytest.approx(
            {"flop_s": per_flop, "row_s": per_row}, rel=1e-6
        )
