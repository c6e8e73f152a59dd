"""The Plan IR: validation, the printed table, JSON round trip, and loading checks."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import replace

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import autopart
from autopart.degrees import Degrees
from autopart.mesh import Mesh
from autopart.plan import Alternative, MeshSpec, Plan, PlanError, Predicted, StageFigures
from autopart.plan_format import alternative_label, reordering_difference
from tests.models import MLP, tiny_mixtral, token_batch


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
    stale = "predictions: current -> stale (made before an edit)"
    assert plan.diff(edited) == ["zero: 1 -> 2", stale]
    with pytest.raises(PlanError):
        plan.with_changes(zero=5)


def test_an_edit_marks_the_predictions_stale(tmp_path):
    """The predictions describe the plan they were made for: an edit keeps them, marked
    stale in the table, the explanation and the plan file; new predictions, or a change
    to what was predicted alone, are not stale."""
    plan = _plan()
    assert not plan.predictions_stale and "stale" not in str(plan) + plan.explain()
    edited = plan.with_changes(zero=2)
    assert edited.predictions_stale
    assert edited.predicted == plan.predicted
    assert "stale: these predictions are the plan's before it was edited" in str(edited)
    assert "Stale: these predictions" in edited.explain()
    path = tmp_path / "plan.json"
    edited.save(path)
    assert Plan.load(path).predictions_stale
    assert not plan.with_changes(zero=1).predictions_stale  # no change
    assert not plan.with_changes(alternatives=()).predictions_stale
    assert not edited.with_changes(predicted=plan.predicted).predictions_stale
    assert not _plan(predicted=None).with_changes(zero=2).predictions_stale  # nothing to be


def test_diff_lines_are_short_and_fold_repeated_layers():
    layers = {f"model.layers.{i}.mlp.weight": (Replicate(), Shard(0)) for i in range(32)}
    plan = _plan(placements=layers, alternatives=(_alternative(0.6),))
    other = plan.with_changes(
        placements={k: (Replicate(), Replicate()) for k in layers},
        predicted=replace(plan.predicted, step_time_s=0.45, peak_memory_bytes=12 * 1024**3),
        alternatives=(),
    )
    assert plan.diff(other) == [
        "placements[model.layers.*.mlp.weight (×32)]: R S(0) -> R R",
        "predicted step: 500.00 -> 450.00 ms",
        "predicted peak memory: 10.00 GiB -> 12.00 GiB",
        "alternatives: pp=2 dp=4 ep=1 cp=1 tp=2 zero=1 m=4 1f1b -> none",
    ]
    assert plan.diff(plan.with_changes(predicted=None)) == [
        "predicted: step 500.00 ms, peak 10.00 GiB -> none"
    ]


def _alternative(step_time_s: float, memory: int = 8 * 1024**3, **changes) -> Alternative:
    fields = dict(degrees=Degrees(dp=4, tp=2, pp=2), zero=1, microbatches=4, schedule="1f1b")
    return Alternative(**(fields | changes), step_time_s=step_time_s, peak_memory_bytes=memory)


def test_alternatives_show_what_they_switch_on_and_their_gap():
    """Alternatives that differ in virtual stages, sequence parallelism or recomputation
    read differently, each with its gap to the plan, beside the rule that chose it."""
    alternatives = (
        _alternative(0.483, schedule="interleaved-1f1b", virtual_stages=2),
        _alternative(0.49, schedule="interleaved-1f1b", virtual_stages=4, recompute=3),
        _alternative(0.52, 12 * 1024**3, sequence_parallel=True, recompute_attention=2),
    )
    plan = _plan(alternatives=alternatives)
    labels = [alternative_label(a) for a in alternatives]
    assert len(set(labels)) == 3
    assert labels[1].endswith("zero=1 m=4 interleaved-1f1b v=4 recompute 3 blocks")
    assert labels[2].endswith("1f1b sequence_parallel recompute 2 attention cores")
    text = str(plan)
    assert f"{labels[0]}: 483.00 ms, 8.00 GiB (-3.4% step time, -20.0% memory)" in text
    assert "(+4.0% step time, +20.0% memory)" in text
    even = _plan(alternatives=(_alternative(0.49999, 10 * 1024**3),))
    assert "(+0.0% step time, +0.0% memory)" in str(even)
    assert "chosen: the simplest plan within 5% of the fastest" in text
    explained = plan.explain()
    assert "Chosen as the simplest plan within 5% of the fastest that fits" in explained
    assert f"{labels[0]}, is predicted at 483.00 ms and 8.00 GiB (-3.4% step time" in explained


def test_print_shows_offload_master_weights_compression_and_local_sgd():
    offloaded = _plan(offload=True, offload_reason="needs 90 GiB", master_weights="host")
    text = str(offloaded)
    assert "offload: the optimizer state lives and steps in host memory" in text
    assert "master weights: fp32 on the host, bf16 copies on the device" in text
    compressed = _plan(zero=0, grad_compression="powersgd:rank=4")
    assert "gradient compression: powersgd:rank=4 (changes the math)" in str(compressed)
    local = _plan(zero=0, sync_every=8, sync_warmup=100, outer_optimizer="sgd:lr=0.7")
    assert (
        "local SGD: parameters averaged every 8 steps after 100 plain steps, outer optimizer "
        "sgd:lr=0.7 (changes the math)"
    ) in str(local)
    assert not any(w in str(_plan()) for w in ("offload", "master weights", "compression", "SGD"))


def test_plan_for_another_model_or_mesh_is_refused(tmp_path):
    # Small MLPs: the checks read the model's fingerprint alone, not what it holds.
    x = torch.randn(4, 32)
    mesh = Mesh.cluster("cpu", nodes=1, per_node=2)
    plan = autopart.plan(MLP(depth=3), mesh, (x,))
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = Plan.load(path)
    with pytest.raises(PlanError, match="made for another model"):
        autopart.parallelize(MLP(depth=2), mesh, (x,), plan=loaded)
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
    x = torch.randn(4, 32)  # a small MLP: the pins and the optimizer are what is wrong
    mesh = Mesh.cluster("cpu", nodes=1, per_node=2)
    with pytest.raises(PlanError, match="degree of tp must be a positive integer, not 0"):
        autopart.plan(MLP(), mesh, (x,), tp=0)
    with pytest.raises(PlanError, match="pinned tp=3 = 3 devices do not divide the 2"):
        autopart.plan(MLP(), mesh, (x,), tp=3)
    with pytest.raises(TypeError, match="LBFGS.step needs a closure"):
        autopart.parallelize(MLP(), mesh, (x,), optimizer=torch.optim.LBFGS)


def test_recomputed_layers_print_as_one_run():
    plan = _plan(recompute=tuple(f"model.layers.{i}" for i in range(4)))
    assert "recompute: model.layers.0-3 (4 blocks)" in str(plan)


def test_explain_says_which_sums_change_order():
    explained = _plan().explain()
    assert "Sums in another order than on one device" in explained
    assert (
        f"gradients over the 4 data-parallel ranks × 4 microbatches (fp32: about "
        f"{reordering_difference('fp32', 16):.0e})"
    ) in explained
    assert f"over the 2 tp ranks (bf16: about {reordering_difference('bf16', 2):.0e})" in explained
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


@pytest.mark.slow  # test_report's quick test explains an ep plan
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


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _added(parts: Iterable[torch.Tensor]) -> torch.Tensor:
    """Partial results added one after another, in their dtype, as a ring does; taken
    one at a time, so that a thousand of them are never held at once."""
    parts = iter(parts)
    total = next(parts)
    for part in parts:
        total = total + part
    return total


@pytest.mark.parametrize(("dtype", "tp"), [("bf16", 2), ("bf16", 8), ("fp16", 8), ("fp32", 8)])
def test_the_rounding_estimate_matches_a_row_parallel_product(dtype, tp):
    """A row-parallel product, as one device computes it and as tp ranks do (each its
    columns' product in the dtype, then added), differs as `explain()` says."""
    torch.manual_seed(0)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    x, w = torch.randn(64, 4096).to(dt), torch.randn(4096, 256).to(dt)
    ranks = _added([xc @ wc for xc, wc in zip(x.chunk(tp, 1), w.chunk(tp, 0))])
    measured = _relative(ranks, x @ w)
    assert 0.5 < measured / reordering_difference(dtype, tp) < 2


@pytest.mark.parametrize("parts", [2, 16, 1024])
def test_the_rounding_estimate_matches_a_gradient_summed_over_parts(parts):
    """A weight's fp32 gradient over a batch of 1024, taken whole and as the sum of
    `parts` parts' gradients (data-parallel ranks × microbatches)."""
    torch.manual_seed(0)
    x, dy = torch.randn(1024, 256), torch.randn(1024, 256)
    summed = _added(xc.T @ dc for xc, dc in zip(x.chunk(parts), dy.chunk(parts)))
    measured = _relative(summed, x.T @ dy)
    assert 0.5 < measured / reordering_difference("fp32", parts) < 2
