"""Predictions for whole plans: Llama-3-8B on H100 meshes (meta device), pipelines,
stage cuts, recomputation, and graphs captured with a static batch."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from autopart.capture import capture
from autopart.cost_models.choices import Choices
from autopart.cost_models.comm import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, CommModel
from autopart.cost_models.pipeline import bucket_sizes
from autopart.cost_models.predict import predict
from autopart.cost_models.summary import GraphSummary
from autopart.degrees import Degrees
from autopart.mesh import PRESETS, Mesh
from autopart.passes import analyze
from autopart.plan import MeshSpec, Plan
from autopart.policy import FIRST_GRAD_BUCKET_BYTES, GRAD_BUCKET_BYTES
from tests.models import tiny_gpt2, token_batch

GB = 1e9
BF16_PEAK = 989.4e12
NODE = Mesh.cluster("h100-80g", nodes=1, per_node=8)
CLUSTER = Mesh.cluster("h100-80g", nodes=128, per_node=8)


def _parts_add_up(p):
    assert p.step_time_s == pytest.approx(p.compute_s + p.exposed_comm_s + p.bubble_s)
    assert p.peak_memory_bytes == sum(p.memory.values())


def test_llama3_8b_data_parallel_on_one_node(llama3_8b_graph):
    p = predict(
        llama3_8b_graph,
        NODE,
        Choices(global_batch=8, precision="bf16-mixed", degrees=Degrees(dp=8)),
    )
    _parts_add_up(p)
    mfu = p.model_flops_per_device / BF16_PEAK
    assert 0.1 < mfu < 0.8
    assert p.bubble_s == 0.0
    # 8.03B parameters: autocast keeps fp32 weights and gradients, 8 bytes of Adam state.
    assert p.memory["parameters"] == pytest.approx(4 * 8.03e9, rel=0.01)
    assert p.memory["optimizer"] == pytest.approx(8 * 8.03e9, rel=0.01)


def test_llama3_8b_fp32_adam_does_not_fit_plain_data_parallel(llama3_8b_graph):
    p = predict(
        llama3_8b_graph, NODE, Choices(global_batch=8, precision="fp32", degrees=Degrees(dp=8))
    )
    _parts_add_up(p)
    assert p.peak_memory_bytes > 16 * GB
    assert p.memory["parameters"] + p.memory["gradients"] + p.memory["optimizer"] == (
        pytest.approx(16 * 8.03e9, rel=0.01)
    )
    zero3 = predict(llama3_8b_graph, NODE, Choices(global_batch=8, zero=3, degrees=Degrees(dp=8)))
    assert zero3.memory["optimizer"] == pytest.approx(p.memory["optimizer"] / 8, rel=0.01)
    assert zero3.peak_memory_bytes < p.peak_memory_bytes / 3


def test_tensor_parallel_shards_weights_and_pays_all_reduces(llama3_8b_graph):
    dp = predict(
        llama3_8b_graph,
        NODE,
        Choices(global_batch=8, precision="bf16-mixed", degrees=Degrees(dp=8)),
    )
    tp = predict(
        llama3_8b_graph,
        NODE,
        Choices(global_batch=8, precision="bf16-mixed", degrees=Degrees(tp=8)),
    )
    assert tp.memory["parameters"] == pytest.approx(dp.memory["parameters"] / 8, rel=0.02)
    assert tp.exposed_comm_s > dp.exposed_comm_s


def test_recomputation_trades_activations_for_time(llama3_8b_graph):
    plain = Choices(global_batch=16, zero=3, precision="bf16-mixed", degrees=Degrees(dp=8))
    recompute = Choices(
        global_batch=16,
        zero=3,
        precision="bf16-mixed",
        recompute=("model.layers",),
        degrees=Degrees(dp=8),
    )
    a, b = predict(llama3_8b_graph, NODE, plain), predict(llama3_8b_graph, NODE, recompute)
    assert b.memory["activations"] < a.memory["activations"] / 5
    assert b.compute_s > a.compute_s
    # Under ZeRO-3 the recomputation's gather is backward's (ops/zero3.py): the same two
    # blocks gathered at most, no more bytes gathered, more compute to hide them behind.
    assert b.memory["buffers"] == a.memory["buffers"]
    assert b.exposed_comm_s <= a.exposed_comm_s


def test_pipelines_on_a_thousand_devices(llama3_8b_graph):
    summary = GraphSummary(llama3_8b_graph)
    base = {
        "global_batch": 1024,
        "degrees": Degrees(dp=32, tp=8, pp=4),
        "microbatches": 8,
        "precision": "bf16-mixed",
    }
    one = predict(summary, CLUSTER, Choices(**base, schedule="1f1b"))
    gpipe = predict(summary, CLUSTER, Choices(**base, schedule="gpipe"))
    interleaved = predict(
        summary, CLUSTER, Choices(**base, schedule="interleaved-1f1b", virtual_stages=2)
    )
    for p in (one, gpipe, interleaved):
        _parts_add_up(p)
        assert 0.05 < p.model_flops_per_device / BF16_PEAK < 0.8
    # GPipe's forwards pace at the slowest forward, its backwards at the slowest
    # backward, which unbalanced stages (the head's) leave slower than 1F1B's pace.
    assert one.step_time_s <= gpipe.step_time_s < 1.05 * one.step_time_s
    assert one.memory["activations"] < gpipe.memory["activations"]
    assert interleaved.bubble_s < one.bubble_s


def test_stage_cuts_place_the_boundary(llama3_8b_graph):
    summary = GraphSummary(llama3_8b_graph)
    choices = {
        "global_batch": 64,
        "degrees": Degrees(dp=4, pp=2),
        "microbatches": 4,
        "schedule": "1f1b",
    }
    even = predict(summary, NODE, Choices(**choices, stage_cuts=("model.layers.16",)))
    uneven = predict(summary, NODE, Choices(**choices, stage_cuts=("model.layers.4",)))
    assert uneven.step_time_s > even.step_time_s
    assert uneven.peak_memory_bytes > even.peak_memory_bytes
    with pytest.raises(ValueError, match="names no module"):
        predict(summary, NODE, Choices(**choices, stage_cuts=("model.nowhere",)))


def test_choices_of_a_plan(llama3_8b_graph):
    plan = Plan(
        MeshSpec("h100-80g", 1, 8),
        "f",
        global_batch=8,
        precision="bf16-mixed",
        degrees=Degrees(dp=8),
    )
    p = predict(llama3_8b_graph, NODE, Choices.of(plan))
    q = predict(
        llama3_8b_graph,
        NODE,
        Choices(global_batch=8, precision="bf16-mixed", degrees=Degrees(dp=8)),
    )
    assert p == q


def test_a_static_batch_graph_is_scaled_to_the_microbatch():
    model = tiny_gpt2()
    ids, _ = token_batch(batch=8)
    graphs = {}
    for dynamic in (True, False):
        captured = capture(model, (ids,), dynamic_batch=dynamic)
        analyze(captured.gm, captured.context())
        graphs[dynamic] = captured.gm
    mesh = Mesh.cluster("cpu", nodes=1, per_node=2)
    dynamic, static = (
        predict(graphs[d], mesh, Choices(global_batch=8, microbatches=2, degrees=Degrees(dp=2)))
        for d in (True, False)
    )
    assert static.compute_s == pytest.approx(dynamic.compute_s, rel=0.05)
    assert static.memory["activations"] == pytest.approx(dynamic.memory["activations"], rel=0.05)


def test_plain_cpu_mesh_gives_finite_numbers():
    with torch.device("meta"):
        model = tiny_gpt2()
    captured = capture(model, (torch.zeros(4, 16, dtype=torch.long, device="meta"),))
    analyze(captured.gm, captured.context())
    p = predict(captured.gm, Mesh.cluster("cpu", 1, 1), Choices(global_batch=4))
    _parts_add_up(p)
    assert p.step_time_s > 0 and p.exposed_comm_s == 0.0


def test_a_cpu_pays_its_whole_gradient_all_reduce_a_gpu_hides_it_behind_backward():
    # 4 MB of gradients, in buckets of 1 MB (the first) and 3 MB. Gloo reduces them on
    # the cores that compute: on a CPU both add their time to the step; on the same
    # figures taken for a GPU's, the first hides behind backward and the last shows.
    gm, grad_bytes = _four_linears()
    buckets = bucket_sizes(grad_bytes, GRAD_BUCKET_BYTES, FIRST_GRAD_BUCKET_BYTES)
    assert len(buckets) == 2
    choices = Choices(global_batch=64, degrees=Degrees(dp=2))
    cpu = PRESETS["cpu"]
    on_cpu = predict(gm, Mesh.cluster(cpu, 1, 2), choices)
    as_gpu = predict(gm, Mesh.cluster(replace(cpu, name="gpu-like"), 1, 2), choices)
    assert on_cpu.compute_s == pytest.approx(as_gpu.compute_s)
    first = CommModel(Mesh.cluster(cpu, 1, 2)).time(ALL_REDUCE, buckets[0], 2)
    assert on_cpu.exposed_comm_s - as_gpu.exposed_comm_s == pytest.approx(first)


def _four_linears():
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])
    captured = capture(model, (torch.zeros(64, 512, device="meta"),))
    analyze(captured.gm, captured.context())
    return captured.gm, 4 * sum(p.numel() for p in captured.gm.parameters())


@pytest.mark.parametrize("microbatches", [1, 2])
def test_zero_1_and_2_pass_over_the_gradients_as_their_buckets_do(microbatches):
    # ZeRO-1 zeroes its flat buckets (1 pass over the gradients G), adds every
    # microbatch's in (3G each) and divides them (2G); ZeRO-2 flattens and divides each
    # microbatch's (4G each), a copy into a view of the flat buffer for each of the 8
    # tensors, each at the operator floor. Their optimizers step the same shards.
    gm, grad_bytes = _four_linears()
    cpu = Mesh.cluster("cpu", 1, 2)

    def plan(zero):
        choices = Choices(global_batch=64, degrees=Degrees(dp=2), zero=zero)
        return predict(gm, cpu, replace(choices, microbatches=microbatches))

    passes = (1 + 3 * microbatches + 2) - 4 * microbatches
    pass_s = grad_bytes / PRESETS["cpu"].memory_bandwidth
    copies_s = microbatches * 8 * PRESETS["cpu"].kernel_launch_s
    assert plan(1).compute_s - plan(2).compute_s == pytest.approx(passes * pass_s - copies_s)


def test_zero_1_gathers_every_bucket_of_its_updated_parameters():
    # One reduce-scatter and one all-gather a bucket where ZeRO-0 runs one all-reduce:
    # on a CPU each is a collective of its own, none hidden.
    gm, grad_bytes = _four_linears()
    cpu = Mesh.cluster("cpu", 1, 2)
    comm = CommModel(cpu)
    buckets = bucket_sizes(grad_bytes, GRAD_BUCKET_BYTES, FIRST_GRAD_BUCKET_BYTES)
    assert len(buckets) == 2

    def summed(op):
        return sum(comm.time(op, b, 2) for b in buckets)

    choices = Choices(global_batch=64, degrees=Degrees(dp=2))
    plain = predict(gm, cpu, choices)
    zero1 = predict(gm, cpu, replace(choices, zero=1))
    extra = summed(REDUCE_SCATTER) + summed(ALL_GATHER) - summed(ALL_REDUCE)
    assert zero1.exposed_comm_s - plain.exposed_comm_s == pytest.approx(extra)


def test_zero_2_reduce_scatters_every_microbatch():
    # On a CPU nothing hides: a second microbatch is a second reduce-scatter of every
    # bucket under ZeRO-2, none more under ZeRO-1.
    gm, grad_bytes = _four_linears()
    cpu = Mesh.cluster("cpu", 1, 2)
    comm = CommModel(cpu)
    buckets = bucket_sizes(grad_bytes, GRAD_BUCKET_BYTES, FIRST_GRAD_BUCKET_BYTES)
    scatter = sum(comm.time(REDUCE_SCATTER, b, 2) for b in buckets)
    choices = Choices(global_batch=64, degrees=Degrees(dp=2), microbatches=2)
    one = predict(gm, cpu, replace(choices, zero=1))
    two = predict(gm, cpu, replace(choices, zero=2))
    assert two.exposed_comm_s - one.exposed_comm_s == pytest.approx(scatter)
