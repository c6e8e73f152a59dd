"""The Plan IR: validation, the printed table, JSON round trip, and loading checks."""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import autopart
from autopart.degrees import Degrees
from autopart.mesh import Mesh
from autopart.plan import MeshSpec, Plan, PlanError, Predicted, StageFigures
from tests.models import tiny_gpt2, tiny_llama, tiny_mixtral, token_batch


def _plan(**changes) -> Plan:
    fields = dict(
        mesh=MeshSpec("h100-80g", 2, 8),
        fingerprint="abc",
        global_batch=64,
        degrees=Degrees(dp=4, tp=2, pp=2),
        zero=1,
        microbatches=4,
        schedule="1f1b",
        precision="bf16-mixed",
        recompute=("model.layers.0",),
        stage_cuts=("model.layers.2",),
        placements={"fc.weight": (Replicate(), Shard(0)), "fc.bias": (Replicate(), Shard(0))},
        predicted=Predicted(
            0.5,
            0.4,
            0.05,
            0.05,
            10 * 1024**3,
            {"parameters": 1024**3},
            1e14,
            stages=(
                StageFigures(2, 0.1, 10 * 1024**3, 2, 1, 512 * 1024**2, 0.02, 0.01),
                StageFigures(2, 0.09, 8 * 1024**3, 1, tp_comm_s=0.01),
            ),
        ),
    )
    axes = {k: changes.pop(k) for k in ("dp", "tp", "pp") if k in changes}
    fields.update(changes, degrees=fields["degrees"].replace(**axes))
    return Plan(**fields)


def test_json_round_trip_is_exact(tmp_path):
    plan = _plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    assert json.loads(path.read_text())["version"] == 1
    assert Plan.load(path) == plan


def test_table_and_explanation_name_the_choices():
    plan = _plan()
    text = str(plan)
    for part in ("dp=4", "tp=2", "pp=2", "zero=1", "schedule=1f1b", "fc.weight", "S(0)"):
        assert part in text
    explained = plan.explain()
    assert "ZeRO-1 shards the optimizer state" in explained
    assert "Tensor parallelism shards 2 of 2 parameter tensors over the 2 tp ranks" in explained
    assert "10.00 ms per step on the busiest rank (2% of the step)" in explained
    assert "stage 0: 2 blocks and the embedding before the first, 100.00 ms" in explained
    assert "10.00 GiB with 2 microbatches in flight, 1 block recomputed" in explained
    assert "stage 1: 2 blocks and the head after the last" in explained
    assert "stage 0: 1 block frees 512.00 MiB of activations for 20.00 ms more" in explained


def test_invalid_plans_say_what_is_wrong():
    with pytest.raises(PlanError, match="does not cover the 16 devices"):
        _plan(dp=2)
    with pytest.raises(PlanError, match="needs a schedule"):
        _plan(schedule=None)
    with pytest.raises(PlanError, match="does not split into dp=4"):
        _plan(global_batch=6)


def test_edits_are_validated_and_diffed():
    plan = _plan()
    edited = plan.with_changes(zero=2)
    assert plan.diff(edited) == ["zero: 1 -> 2"]
    with pytest.raises(PlanError):
        plan.with_changes(zero=5)


def test_plan_for_another_model_or_mesh_is_refused(tmp_path):
    ids = token_batch(4)[0]
    mesh = Mesh.cluster("cpu", nodes=1, per_node=2)
    plan = autopart.plan(tiny_gpt2(), mesh, (ids,))
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = Plan.load(path)
    with pytest.raises(PlanError, match="made for another model"):
        autopart.parallelize(tiny_llama(), mesh, (ids,), plan=loaded)
    with pytest.raises(PlanError, match="made for the mesh 1×2 cpu"):
        loaded.check_compatible(loaded.fingerprint, Mesh.cluster("cpu", nodes=1, per_node=4))


def test_a_file_of_another_version_is_refused(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_plan().to_json() | {"version": 99}))
    with pytest.raises(PlanError, match="version 99 is not supported"):
        Plan.load(path)


def test_bad_plan_files_and_pins_say_what_is_wrong(tmp_path):
    with pytest.raises(PlanError, match="no plan file at"):
        Plan.load(tmp_path / "missing.json")
    data = _plan().to_json() | {"dp": "4"}
    with pytest.raises(PlanError, match="degree of dp must be a positive integer, not '4'"):
        Plan.from_json(data)
    ids = token_batch(4)[0]
    mesh = Mesh.cluster("cpu", nodes=1, per_node=2)
    with pytest.raises(PlanError, match="degree of tp must be a positive integer, not 0"):
        autopart.plan(tiny_gpt2(), mesh, (ids,), tp=0)
    with pytest.raises(PlanError, match="pinned tp=3 = 3 devices do not divide the 2"):
        autopart.plan(tiny_gpt2(), mesh, (ids,), tp=3)
    with pytest.raises(TypeError, match="LBFGS.step needs a closure"):
        autopart.parallelize(tiny_gpt2(), mesh, (ids,), optimizer=torch.optim.LBFGS)


def test_recomputed_layers_print_as_one_run():
    plan = _plan(recompute=tuple(f"model.layers.{i}" for i in range(4)))
    assert "recompute: model.layers.0-3 (4 blocks)" in str(plan)


def test_explain_says_which_sums_change_order():
    assert "Sums in another order than on one device" in _plan().explain()
    alone = _plan(
        mesh=MeshSpec("h100-80g", 1, 1),
        global_batch=1,
        dp=1,
        tp=1,
        pp=1,
        microbatches=1,
        schedule=None,
        stage_cuts=(),
    )
    assert "Every sum runs in the order it runs on one device" in alone.explain()


def test_an_expert_parallel_plan_shows_the_experts_split_over_ep(tmp_path):
    """ep's column: the stacked expert weights on dim 0, the other weights whole on every
    ep rank but for ZeRO-3's shards, which span dp × ep; kept through the plan file."""
    ids, _ = token_batch(8)
    mesh = Mesh.cluster("cpu", nodes=1, per_node=4)
    plan = autopart.plan(tiny_mixtral(), mesh, (ids,), ep=2, dp=2, tp=1, pp=1, cp=1, zero=1)
    experts = "model.layers.*.mlp.experts.gate_up_proj (×2)"
    rows = {line.split("  ")[1]: line.split()[-3:] for line in str(plan).splitlines()[6:]}
    assert rows[experts] == ["R", "S(0)", "R"]
    assert rows["lm_head.weight"] == ["R", "R", "R"]
    assert "parameters dp:R/ep:S(0)/tp:R" in plan.explain()
    zero3 = autopart.plan(tiny_mixtral(), mesh, (ids,), ep=2, dp=2, tp=1, pp=1, cp=1, zero=3)
    assert "parameters dp:S(0)/ep:S(0)/tp:R" in zero3.explain()
    assert "dp:S(0)/ep:R" not in zero3.explain()
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path).ep_params == plan.ep_params
    assert len(plan.ep_params) == 4  # two layers' gate_up and down
