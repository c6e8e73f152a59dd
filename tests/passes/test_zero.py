"""The ZeRO-3 rewrite on one process: buckets, the per-rank graph, the prefetch order.

A "fake" process group of 4 stands for the data-parallel world: the pass needs only the
group's name, this rank's place and the size; nothing is communicated."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import autopart
from autopart.capture import capture
from autopart.ops.flat_buckets import FlatLayout
from autopart.ops.groups import MeshGroups
from autopart.ops.params import parameter_attributes
from autopart.ops.zero3 import all_gather_start, all_gather_wait, sharded_parameters
from autopart.passes import analyze
from autopart.passes.retarget import drop_capture_assertions_pass
from autopart.passes.rewrite import rank_program
from autopart.passes.runner import RankTarget
from autopart.passes.zero import zero3_pass
from autopart.solver import Pins, make_plan
from tests.models import LM_FACTORIES, token_batch

DP = 4


@pytest.fixture(scope="module")
def groups():
    if dist.is_initialized():
        pytest.skip("needs a process group of its own")
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=DP)
    yield MeshGroups(
        init_device_mesh("cpu", (1, DP, 1, 1, 1), mesh_dim_names=("pp", "dp", "ep", "cp", "tp"))
    )
    dist.destroy_process_group()


def _rewritten(model_name: str, groups: MeshGroups, disabled: frozenset[str] = frozenset()):
    model = LM_FACTORIES[model_name]()
    ids, _ = token_batch()
    captured = capture(model, (ids,))
    analyze(captured.gm, captured.context())
    mesh = autopart.Mesh.cluster("cpu", nodes=1, per_node=DP)
    plan = make_plan(captured, mesh, Pins.of(dp=DP, zero=3))
    ctx = captured.context(target=RankTarget(plan, groups))
    ctx.disabled = disabled
    return model, zero3_pass(drop_capture_assertions_pass(captured.gm, ctx), ctx)


def _calls(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


@pytest.mark.parametrize("model_name", ["gpt2", "llama"])
def test_parameters_become_one_shard_per_block(model_name, groups):
    model, gm = _rewritten(model_name, groups)
    zero3 = sharded_parameters(gm)
    layers = "transformer.h" if model_name == "gpt2" else "model.layers"
    blocks = [{n.split(".")[2] for n in names if n.startswith(layers)} for names in zero3.names]
    assert blocks[1:3] == [{"0"}, {"1"}] and blocks[0] == blocks[3] == set()
    whole = dict(model.named_parameters())
    assert sorted(n for names in zero3.names for n in names) == sorted(whole)
    for names, shard in zip(zero3.names, zero3.shards):
        numel = sum(whole[n].numel() for n in names)
        assert shard.numel() == -(-numel // DP)  # a quarter, padded
    # The graph reads no parameter any more: the shards are the stage's only ones.
    assert [n for n, _ in gm.named_parameters()] == [f"zero3.shards.{i}" for i in range(4)]
    assert parameter_attributes(gm) == []


def test_the_rank_owns_its_slice_of_each_bucket(groups):
    model, gm = _rewritten("llama", groups)
    zero3 = sharded_parameters(gm)
    whole = dict(model.named_parameters())
    rank = groups.rank(autopart.mesh.Axis.DP)
    for names, layout, shard in zip(zero3.names, zero3.layouts, zero3.shards):
        flat = torch.cat([whole[n].detach().flatten() for n in names])
        padded = torch.cat([flat, flat.new_zeros(layout.padded - flat.numel())])
        assert torch.equal(shard.detach(), padded[layout.shard_slice(rank)])


def test_each_gather_is_issued_when_the_previous_is_taken_and_waited_before_use(groups):
    _, gm = _rewritten("gpt2", groups)
    nodes = list(gm.graph.nodes)
    waits = _calls(gm, all_gather_wait)
    for previous, wait in zip(waits, waits[1:]):
        assert nodes[nodes.index(previous) + 1] is wait.args[2]  # prefetch: right after
    for wait in waits:
        after = nodes[nodes.index(wait) + 1 :]
        bookkeeping = (operator.getitem, all_gather_start)
        first_compute = next(n for n in after if n.target not in bookkeeping)
        assert any(a.args[0] is wait for a in first_compute.all_input_nodes)
    # The tied embedding is gathered again for the head instead of staying whole.
    assert [w.args[1] for w in waits] == [0, 1, 2, 3, 0]


def test_without_the_prefetch_pass_each_gather_waits_at_once(groups):
    _, gm = _rewritten("gpt2", groups, disabled=frozenset({"zero3_prefetch_pass"}))
    nodes = list(gm.graph.nodes)
    for wait in _calls(gm, all_gather_wait):
        assert nodes[nodes.index(wait) - 1] is wait.args[2]


def test_flat_layout_pads_to_the_group_and_round_trips():
    tensors = [torch.arange(6.0).view(3, 2), torch.arange(6.0, 11.0)]
    layout = FlatLayout.of(tensors, 4)
    assert (layout.numel, layout.padded, layout.shard_numel) == (11, 12, 3)
    flat = layout.flatten(tensors, like=tensors[0])
    assert torch.equal(flat, torch.tensor([*range(11), 0.0]))
    assert all(torch.equal(v, t) for v, t in zip(layout.views(flat), tensors))
    assert torch.equal(layout.shard_of(tensors, 3), torch.tensor([9.0, 10.0, 0.0]))
    assert torch.equal(layout.flatten([None, tensors[1]], like=flat)[:6], torch.zeros(6))


def test_a_data_parallel_axis_of_one_keeps_its_parameters(groups):
    alone = MeshGroups(
        init_device_mesh("cpu", (DP, 1, 1, 1, 1), mesh_dim_names=("pp", "dp", "ep", "cp", "tp"))
    )
    model, gm = _rewritten("llama", alone)
    assert sharded_parameters(gm) is None
    assert sorted(n for n, _ in gm.named_parameters()) == sorted(dict(model.named_parameters()))


@pytest.mark.parametrize("disabled", [frozenset(), frozenset({"zero3_pass"})])
def test_rank_program_runs_the_declared_rewrites_timed_and_disableable(groups, disabled):
    """`rank_program` applies `REWRITES` through `run_passes`: every rewrite that
    applies is timed, and one disabled by name does not run."""
    ids, _ = token_batch()
    captured = capture(LM_FACTORIES["llama"](), (ids,))
    analyze(captured.gm, captured.context())
    mesh = autopart.Mesh.cluster("cpu", nodes=1, per_node=DP)
    plan = make_plan(captured, mesh, Pins.of(dp=DP, zero=3))
    ctx = captured.context(target=RankTarget(plan, groups), disabled=disabled)
    program = rank_program(captured.gm, ctx)
    ran = {"drop_capture_assertions_pass", "causal_attention_pass", "materialize_pass"}
    assert ran | {"retarget_devices_pass"} <= set(ctx.timings)
    assert "tensor_parallel_pass" not in ctx.timings  # tp = 1: it does not apply
    assert ("zero3_pass" in ctx.timings) == (not disabled)
    assert (sharded_parameters(program.stages[0]) is None) == bool(disabled)
