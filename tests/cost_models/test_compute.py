"""The roofline compute model, and the Megatron-LM FLOPs formula matched by the analysis
passes plus the model's accounting of forward, backward and recomputation."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopart.capture import capture
from autopart.cost_models.compute import (
    ADAM_OPERATORS_PER_TENSOR,
    ADAM_TRAFFIC,
    ComputeModel,
    PhaseCost,
    training_flops,
)
from autopart.cost_models.precision import bytes_scale, cast_bytes
from autopart.cost_models.summary import GraphSummary
from autopart.cost_models.work import MATMUL, OTHER, NodeWork, evaluate, node_work
from autopart.mesh import PRESETS
from autopart.ops.aten import op_name
from autopart.passes import MODULE_PATH, analyze, total_flops
from tests.cost_models.conftest import GPT

H100 = PRESETS["h100-80g"]


def _matmul(m, n, k):
    return NodeWork(
        MATMUL,
        2.0 * m * n * k,
        read_bytes=4.0 * m * k,
        written_bytes=4.0 * m * n,
        param_bytes=4.0 * k * n,
        shape=(m, n, k),
    )


def test_megatron_flops_formula_with_recomputation(gpt_graph):
    # Narayanan et al. 2021, appendix: 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) FLOPs per
    # iteration with full recomputation: 4× the transformer layers' forward, 3× the LM head's.
    b, s, layers, h, v = GPT["batch"], GPT["seq"], GPT["layers"], GPT["hidden"], GPT["vocab"]
    formula = 96 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (16 * layers * h))
    segments = GraphSummary(gpt_graph).evaluate({"batch": b, "seq": s})
    flops = sum(
        (training_flops(seg.nodes, recompute=seg.is_block) for seg in segments), PhaseCost()
    )
    assert flops.total == pytest.approx(formula, rel=0.03)
    # The forward alone: 24·B·s·l·h²·(1 + s/(6h)) + 2·B·s·h·V.
    forward = 24 * b * s * layers * h**2 * (1 + s / (6 * h)) + 2 * b * s * h * v
    at = {"batch": b, "seq": s}
    assert evaluate(total_flops(gpt_graph), at) == pytest.approx(forward, rel=0.03)
    assert flops.forward == pytest.approx(forward, rel=0.03)
    assert flops.backward == pytest.approx(2 * forward, rel=0.03)


def test_efficiency_saturates_at_the_device_cap_without_a_shape_model():
    # A device with no SM count (a CPU, a calibrated profile): the saturating curve.
    cpu = PRESETS["cpu"]
    model = ComputeModel(cpu, "fp32")
    assert model.efficiency(8192, 8192, 8192) == pytest.approx(cpu.matmul_efficiency, rel=0.01)
    assert model.efficiency(4096, 4096, 64) < model.efficiency(4096, 4096, 4096)
    half = model.half_dim
    assert model.efficiency(half, 4096, 4096) == pytest.approx(cpu.matmul_efficiency / 2)


def test_large_matmul_is_compute_bound_at_the_mixed_precision_peak():
    work = _matmul(8192, 8192, 8192)
    bf16 = ComputeModel(H100, "bf16-mixed")
    fp32 = ComputeModel(H100, "fp32")
    peak_time = work.flops / (989.4e12 * bf16.efficiency(8192, 8192, 8192))
    bandwidth = H100.memory_bandwidth
    assert fp32.forward_time(work) > 10 * bf16.forward_time(work)
    # autocast converts the fp32 operands first: read 4, write 2 bytes per element. On a
    # GPU both kernels' launches hide behind the kernels.
    cast = 1.5 * (work.read_bytes + work.param_bytes) / bandwidth
    assert bf16.forward_time(work) == pytest.approx(peak_time + cast)


def test_a_model_built_in_16_bits_has_nothing_to_cast():
    work = replace(_matmul(8192, 8192, 8192), low_precision=True)
    assert cast_bytes(work, "bf16-mixed") == 0.0
    assert bytes_scale(work, "bf16-mixed") == 1.0
    bf16 = ComputeModel(H100, "bf16-mixed")
    assert bf16.forward_time(work) < bf16.forward_time(_matmul(8192, 8192, 8192))


def test_elementwise_is_memory_bound_and_stays_fp32_under_autocast():
    work = NodeWork(OTHER, 1e8, read_bytes=4e8, written_bytes=4e8)
    fp32 = ComputeModel(H100, "fp32").forward_time(work)
    bf16 = ComputeModel(H100, "bf16-mixed").forward_time(work)
    assert fp32 == pytest.approx(8e8 / H100.memory_bandwidth)  # the launch hides
    assert bf16 == pytest.approx(fp32)
    cpu = PRESETS["cpu"]  # a CPU dispatches each operator on the core that computes it
    on_cpu = ComputeModel(cpu, "fp32").forward_time(work)
    assert on_cpu == pytest.approx(8e8 / cpu.memory_bandwidth + cpu.kernel_launch_s)


def test_mixed_precision_halves_contraction_bytes_and_casts_their_operands():
    matmul, other = _matmul(16, 8192, 8192), NodeWork(OTHER, 1e6, read_bytes=1e7)
    assert bytes_scale(matmul, "bf16-mixed") == 0.5
    assert bytes_scale(other, "bf16-mixed") == bytes_scale(matmul, "fp32") == 1.0
    assert cast_bytes(matmul, "fp16-mixed") == 1.5 * (matmul.read_bytes + matmul.param_bytes)
    assert cast_bytes(other, "bf16-mixed") == cast_bytes(matmul, "fp32") == 0.0


def test_tiny_operators_and_views_pay_the_launch_floor_python_items_do_not():
    slow_launch = ComputeModel(replace(H100, kernel_launch_s=1e-3))
    assert slow_launch.forward_time(_matmul(2, 2, 2)) == pytest.approx(1e-3, rel=1e-3)
    view = NodeWork(OTHER, 0.0)
    assert slow_launch.forward_time(view) == 1e-3
    assert slow_launch.time(view).backward == 1e-3  # its gradient is one more view
    assert slow_launch.forward_time(replace(view, dispatched=False)) == 0.0


def test_views_and_tuple_items_are_told_apart_in_a_graph(gpt_graph):
    at = {"batch": 2, "seq": GPT["seq"]}
    works = [node_work(n, gpt_graph, at, {}) for n in gpt_graph.graph.nodes]
    names = [op_name(n, gpt_graph) for n in gpt_graph.graph.nodes]
    dispatched = {name for name, w in zip(names, works) if w.dispatched}
    assert {"view", "transpose", "addmm"} <= dispatched
    assert not dispatched & {"getitem", "sym_size", ""}  # placeholders, attributes, output


def test_adam_is_memory_bound_plus_a_launch_floor_per_operator_per_tensor():
    model = ComputeModel(H100)
    state = 16 * 8.03e9  # Llama-3-8B: fp32 parameters, gradients, two moments
    memory_bound = ADAM_TRAFFIC * state / H100.memory_bandwidth
    assert model.optimizer_step_time(state) == pytest.approx(memory_bound)
    launches = 291 * ADAM_OPERATORS_PER_TENSOR * H100.kernel_launch_s
    assert model.optimizer_step_time(state, tensors=291) == pytest.approx(memory_bound + launches)
    measured = ComputeModel(replace(H100, optimizer_tensor_s=2e-5))
    assert measured.optimizer_step_time(state, tensors=291) == pytest.approx(
        memory_bound + 291 * 2e-5
    )


def test_backward_is_twice_a_matmul_once_an_elementwise_and_recompute_adds_a_forward():
    model = ComputeModel(H100, "bf16-mixed")
    matmul, other = _matmul(4096, 4096, 4096), NodeWork(OTHER, 1e6, read_bytes=1e7)
    t = model.time(matmul, recompute=True)
    assert t.backward == pytest.approx(2 * t.forward)
    assert t.recompute == t.forward
    assert model.time(other).backward == model.time(other).forward
    flops = training_flops([matmul, other], recompute=True)
    assert flops.total == pytest.approx(4 * matmul.flops + 3 * other.flops)


def test_transcendentals_cost_their_measured_rate_and_again_in_backward_where_recomputed():
    cpu = replace(PRESETS["cpu"], kernel_launch_s=0.0, function_rates={"tanh": 1e8, "silu": 1e8})
    model = ComputeModel(cpu)
    tanh = NodeWork(OTHER, 1e6, read_bytes=4e6, written_bytes=4e6, function="tanh", evaluations=1e6)
    memory = 8e6 / cpu.memory_bandwidth
    arithmetic = 1e6 / cpu.flops_for("fp32") + 1e6 / 1e8
    assert arithmetic > memory  # 10 ms of tanh against 0.4 ms of traffic
    assert model.time(tanh).forward == pytest.approx(arithmetic)
    assert model.time(tanh).backward == pytest.approx(memory)  # 1 − y², from the output
    silu = replace(tanh, function="silu", evaluates_in_backward=True)
    assert model.time(silu).backward == pytest.approx(memory + 1e6 / 1e8)
    unmeasured = ComputeModel(PRESETS["cpu"])  # a data-sheet preset: traffic alone
    assert unmeasured.function_time(tanh) == 0.0


def test_attention_evaluates_exp_once_per_score_gelu_tanh_once_per_element(gpt_graph):
    dims = {"batch": GPT["batch"], "seq": GPT["seq"]}
    works = {
        op_name(n, gpt_graph): node_work(n, gpt_graph, dims, {})
        for n in gpt_graph.graph.nodes
        if MODULE_PATH.get(n).startswith("transformer.h.0.")
    }
    attention = next(w for name, w in works.items() if "attention" in name)
    heads = 16
    assert (attention.function, attention.evaluations) == (
        "exp",
        GPT["batch"] * heads * GPT["seq"] ** 2,
    )
    assert attention.evaluates_in_backward
    tanh = works["tanh"]  # GPT-2's gelu_new: the MLP's 4h activations
    assert (tanh.function, tanh.evaluations) == ("tanh", GPT["batch"] * GPT["seq"] * 4 * 1024)
    assert not tanh.evaluates_in_backward


def test_a_calibrated_compute_scale_multiplies_every_phase():
    work = _matmul(4096, 4096, 4096)
    plain, scaled = ComputeModel(H100), ComputeModel(replace(H100, compute_scale=1.5))
    assert scaled.time(work, recompute=True).total == pytest.approx(
        1.5 * plain.time(work, recompute=True).total
    )


def test_nodes_cost_prices_a_subset(gpt_graph):
    model = ComputeModel(H100, "bf16-mixed")
    nodes = gpt_graph.graph.nodes
    block = [n for n in nodes if MODULE_PATH.get(n).startswith("transformer.h.0")]
    at = {"batch": 2, "seq": GPT["seq"]}
    whole = model.nodes_cost(gpt_graph, at)
    one_block = model.nodes_cost(gpt_graph, at, block)
    assert 0 < one_block.total < whole.total / GPT["layers"]


def test_unknown_precision_is_an_error():
    with pytest.raises(ValueError, match="precision"):
        ComputeModel(H100, "int8")


class _CrossEntropy(nn.Module):
    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, target)


def test_cross_entropy_reads_the_logits_thrice_writes_them_once_and_exponentiates_them():
    rows, vocab = 8, 64
    logits, target = torch.randn(rows, vocab), torch.randint(0, vocab, (rows,))
    captured = capture(_CrossEntropy(), (logits, target))
    analyze(captured.gm, captured.context())
    gm = captured.gm
    node = next(n for n in gm.graph.nodes if op_name(n, gm) == "cross_entropy_loss")
    work = node_work(node, gm, dict(captured.dim_sizes), {})
    assert (work.function, work.evaluations) == ("exp", rows * vocab)
    assert work.written_bytes == 4 * rows * vocab + 4  # the log-probabilities, the loss
    assert work.read_bytes == 3 * 4 * rows * vocab + 8 * rows  # and the class indices
    # Memory-bound: backward's five passes over the logits' size against forward's four.
    model = ComputeModel(replace(PRESETS["cpu"], kernel_launch_s=0.0))
    assert model.time(work).backward == pytest.approx(5 / 4 * model.time(work).forward)
