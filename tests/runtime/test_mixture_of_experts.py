"""A sparse mixture-of-experts decoder (tiny Mixtral: 4 routed experts, top-2, in each
of 2 layers). Its layers are recognized as copies of one block although each routes a
data-dependent number of tokens, so it cuts into two pipeline stages. It trains like
one device under dp=2, pp=2 and expert parallelism ep=2 (alone and with ZeRO-1) on 2
ranks, and ep=2 × dp=2 (alone and with ZeRO-2 over 2 microbatches), ep=2 × pp=2
(1F1B) and ep=2 × tp=2 (each rank's experts split column then row parallel; alone and
with ZeRO-1) on 4; with ZeRO-3 at ep=2 on 2, ep=2 × dp=2 and ep=2 × tp=2 on 4; with
local SGD at ep=2 (one replica) on 2 and averaging every step at ep=2 × dp=2 on 4: 3
steps of SGD with momentum in fp32 on Gloo, every rank's losses and parameters within
1e-5. Local SGD every 2 steps and gradient compression at ep=2 × dp=2 change the math,
as asked: they match two replicas trained apart and bf16's rounding of one device.
SGD, since Adam's update would hide a gradient off by a constant factor (a wrong
divisor in the experts' sync). Under ep each
layer's rows travel to their experts' ranks and back with two all_to_alls, each rank
holds half of every layer's experts, and nothing is dropped."""

from __future__ import annotations

import functools
import math

import pytest
import torch

import autopart
from autopart.api import captured_for_planning
from autopart.capture import capture
from autopart.mesh import Mesh
from autopart.ops.meta import BLOCK
from autopart.ops.zero3 import sharded_parameters
from autopart.passes import analyze
from autopart.solver import Pins, make_plan
from autopart.testing import run_world
from tests.harness import (
    assert_every_rank_matches,
    case_key,
    parallelize_lm,
    train_case,
    train_losses,
)
from tests.models import (
    assert_matches,
    lm_and_router_loss,
    make_optimizer,
    snapshot,
    tiny_llama,
    tiny_mixtral,
    token_batch,
    train_reference,
    train_replicas_apart,
)

STEPS = 3
LAYERS = 2
# The quick suite runs expert parallelism plain and under ZeRO-3; the slow sweeps run the
# rest on 2 ranks and every composition on 4.
CASES = {
    "quick": [
        {"ep": 2, "dp": 1},
        # ZeRO-3: the other weights gathered over ep's 2 ranks, each expert held whole
        {"ep": 2, "dp": 1, "zero": 3},
    ],
    "more": [
        {"dp": 2},
        {"pp": 2, "schedule": "1f1b", "microbatches": 2},
        {"ep": 2, "dp": 1, "zero": 1},  # the other weights' shards over ep's 2 ranks
        # Local SGD with one replica: each local step averages the other weights'
        # gradients over the replica's ep ranks and divides the experts' by ep.
        {"ep": 2, "dp": 1, "sync_every": 2, "sync_warmup": 1},
    ],
    "four": [
        {"ep": 2, "dp": 2},
        {"ep": 2, "dp": 1, "pp": 2, "schedule": "1f1b", "microbatches": 2},
        # The other weights sharded over dp x ep, the experts over dp.
        {"ep": 2, "dp": 2, "zero": 2, "microbatches": 2},
        # Each ep rank's experts split over tp too (column then row parallel).
        {"ep": 2, "tp": 2, "dp": 1},
        {"ep": 2, "tp": 2, "dp": 1, "zero": 1},
        # ZeRO-3: the experts' buckets gathered over their dp replicas, the rest over dp x ep
        {"ep": 2, "dp": 2, "zero": 3},
        {"ep": 2, "tp": 2, "dp": 1, "zero": 3},
        {"ep": 2, "dp": 2, "sync_every": 1},  # local SGD averaging every step: plain dp
    ],
}


def test_routed_layers_are_one_block():
    captured = capture(tiny_mixtral(), (token_batch(8)[0],))
    analyze(captured.gm, captured.context())
    kinds = {b.instance: b.block_id for n in captured.gm.graph.nodes if (b := BLOCK.get(n))}
    assert sorted(kinds) == ["model.layers.0", "model.layers.1"]
    assert len(set(kinds.values())) == 1


def _inspect(pm) -> dict:
    exchanges = [info for _, info in pm.collectives() if info.axis == "ep"]
    held = {
        name: tuple(p.shape) for stage in pm._stage_graphs() for name, p in stage.named_parameters()
    }
    for stage in pm._stage_graphs():  # ZeRO-3's buckets, by the shapes they gather
        zero3 = sharded_parameters(stage)
        for names, layout in zip(zero3.names, zero3.layouts) if zero3 else ():
            held.update((n, tuple(shape)) for n, shape in zip(names, layout.shapes))
    experts = {name: shape for name, shape in held.items() if name in pm.ep_sharded}
    shards = [s.numel() for s in getattr(pm.state, "shards", [])]  # ZeRO's, flat
    gathers = [info.axis for _, info in pm.collectives() if info.kind == "all_gather"]
    return {
        "exchanges": [i.kind for i in exchanges],
        "experts": experts,
        "shards": shards,
        "gathers": gathers,
    }


def _train(batch, cases) -> dict:
    return {
        case_key("mixtral", pins): train_case(
            tiny_mixtral(), batch, STEPS, "sgd", _inspect, **{"tp": 1, "cp": 1, "pp": 1, **pins}
        )
        for pins in cases
    }


@pytest.mark.parametrize(
    "world, cases",
    [
        (2, "quick"),
        pytest.param(2, "more", marks=pytest.mark.slow),
        pytest.param(4, "four", marks=pytest.mark.slow),
    ],
)
def test_mixture_of_experts_trains_like_one_device(world, cases):
    batch = token_batch(8)
    reference = train_reference(tiny_mixtral(), "sgd", STEPS, (batch[0],), batch[1])
    reference_numel = sum(p.numel() for p in reference["params"].values())
    per_rank = run_world(_train, world, batch, CASES[cases])
    for pins in CASES[cases]:
        key = case_key("mixtral", pins)
        assert_every_rank_matches(per_rank, key, reference, label=pins)
        if "ep" not in pins:
            continue
        pipelines = world // pins.get("pp", 1)  # ranks that hold every layer between them
        results = [r[key] for r in per_rank]
        # Into each layer's experts and back out: two all_to_alls per layer and rank.
        assert sum(len(r["exchanges"]) for r in results) == 2 * LAYERS * pipelines
        if pins.get("zero") == 3:  # gathered over the groups their shards span
            expected = {"dp×ep"} | ({"dp"} if pins["dp"] > 1 else set())
            assert {axis for r in results for axis in r["gathers"]} == expected
        assert {k for r in results for k in r["exchanges"]} == {"all_to_all"}
        # Each rank holds 2 of every layer's 4 experts (gate_up and down, per layer),
        # under tp a 1/tp slice of each.
        assert sum(len(r["experts"]) for r in results) == 2 * LAYERS * pipelines
        assert all(shape[0] == 2 for r in results for shape in r["experts"].values())
        whole = {n: math.prod(p.shape) for n, p in reference["params"].items()}
        tp = pins.get("tp", 1)
        for r in results:
            assert {n: math.prod(s) * 2 * tp for n, s in r["experts"].items()} == {
                n: whole[n] for n in r["experts"]
            }
        # Under ZeRO the optimizer steps flat shards: 1/dp of the rank's experts, and
        # 1/(dp·ep) of the other weights (up to each bucket's padding to the group).
        if pins.get("zero"):
            dp, ep = pins["dp"], pins["ep"]
            experts = sum(math.prod(s) for s in results[0]["experts"].values())
            others = (reference_numel - experts * ep * tp) / tp  # a tp slice or whole
            held = sum(results[0]["shards"])
            if tp == 1:
                assert held == pytest.approx(experts / dp + others / (dp * ep), abs=64)
            else:  # some of the other weights stay whole under tp (norms)
                assert experts / dp + others / (dp * ep) <= held < experts / dp + others


def _offloaded(batch) -> dict:
    out = {}
    for zero in (1, 3):
        pm = parallelize_lm(
            tiny_mixtral(), batch, "sgd", tp=1, cp=1, pp=1, ep=2, dp=1, zero=zero, offload=True
        )
        stepped = {id(p) for group in pm.optimizer.param_groups for p in group["params"]}
        offloaded = pm.state.offloaded
        out[zero] = {
            "losses": train_losses(pm, batch, STEPS),
            "params": pm.full_state_dict(),
            "host_copies": offloaded is not None and stepped == {id(h) for h in offloaded.host},
        }
        pm.close()
    return out


@pytest.mark.slow
def test_expert_parallelism_with_offload_trains_like_one_device():
    """ep=2 with ZeRO-1 and ZeRO-3 offloaded: the host steps copies of both kinds of
    shard (the experts' over their dp replicas, the rest over dp × ep)."""
    batch = token_batch(8)
    reference = train_reference(tiny_mixtral(), "sgd", STEPS, (batch[0],), batch[1])
    for results in run_world(_offloaded, 2, batch):
        for zero, result in results.items():
            assert result["host_copies"], zero
            assert_matches(result, reference)


# Opt-ins that change the math, at ep=2 × dp=2 (SGD): local SGD's two replicas (each an
# ep group over its half of the batch) averaged every 2 steps after 1; compression of
# the other weights' all-reduce over dp × ep and of the experts' over their replicas.
OPT_INS = {
    "apart": {"sync_every": 2, "sync_warmup": 1},
    "bf16": {"grad_compression": "bf16"},
    # at a rank no matrix's smaller side reaches, every gradient goes whole
    "powersgd_whole": {"grad_compression": "powersgd:rank=128"},
    # the experts' [2, 64·128] gradients as exact rank-2 factors, the rest lossy
    "powersgd_2": {"grad_compression": "powersgd:rank=2"},
}


def _train_opt_ins(batch) -> dict:
    return {
        name: train_case(tiny_mixtral(), batch, STEPS, "sgd", tp=1, cp=1, pp=1, ep=2, dp=2, **pins)
        for name, pins in OPT_INS.items()
    }


@pytest.mark.slow
def test_local_sgd_and_gradient_compression_under_expert_parallelism():
    batch = token_batch(8)
    start = snapshot(tiny_mixtral())
    one = train_reference(tiny_mixtral(), "sgd", STEPS, (batch[0],), batch[1])
    apart = train_replicas_apart(
        tiny_mixtral, "sgd", STEPS, (batch[0],), batch[1], replicas=2, every=2, warmup=1
    )
    for results in run_world(_train_opt_ins, 4, batch):
        assert_matches(results["apart"], apart)
        with pytest.raises(AssertionError):  # ... which is not one device's training
            assert_matches(results["apart"], one)
        # Every tensor's update within bf16's rounding (measured: 0.3%) of one device's:
        # a wrong divisor of the experts' sum would scale theirs by 2.
        assert_matches(results["bf16"], one, rtol=2e-2)
        for name, want in one["params"].items():
            update, wanted = results["bf16"]["params"][name] - start[name], want - start[name]
            assert (update - wanted).norm() <= 2e-2 * wanted.norm(), name
        with pytest.raises(AssertionError):
            assert_matches(results["bf16"], one, rtol=1e-6)
        assert_matches(results["powersgd_whole"], one)
        assert results["powersgd_2"]["losses"][0] == pytest.approx(one["losses"][0], rel=1e-6)
        with pytest.raises(AssertionError):
            assert_matches(results["powersgd_2"], one, rtol=1e-3)


TWO_CPUS = Mesh.cluster("cpu", nodes=1, per_node=2)
FOUR_CPUS = Mesh.cluster("cpu", nodes=1, per_node=4)


def test_compression_over_ep_alone_says_it_changes_the_math():
    """At dp=1 the ep ranks still all-reduce the other weights' gradients, compressed."""
    ids, _ = token_batch(4)
    plan = autopart.plan(tiny_mixtral(), TWO_CPUS, (ids,), ep=2, grad_compression="bf16")
    assert plan.dp == 1
    assert "the 2 ranks of dp × ep all-reduce the other weights' gradients in bfloat16" in (
        plan.explain()
    )
    assert "This changes the math" in plan.explain()


@pytest.mark.parametrize(
    ("model", "pins", "refusal"),
    [
        (tiny_llama, {"ep": 2}, "no expert layer autopart recognizes.*pin ep=1"),
        (tiny_mixtral, {"ep": 2, "cp": 2}, "ep=2 does not combine with cp=2"),
        # experts 127 wide: tp=2 cannot split them, its layout gathers one
        (
            functools.partial(tiny_mixtral, intermediate=127),
            {"ep": 2, "tp": 2},
            "the layout at tp=2 gathers an expert weight",
        ),
    ],
)
def test_expert_parallelism_it_cannot_run_is_refused_saying_why(model, pins, refusal):
    ids, _ = token_batch(4)
    mesh = TWO_CPUS if pins.get("cp", 1) * pins.get("tp", 1) == 1 else FOUR_CPUS
    with pytest.raises(autopart.PlanError, match=refusal):
        autopart.plan(model(), mesh, (ids,), **pins)


# (world, the plans run one after another from the last one's checkpoint: steps, pins)
RESUMED = {
    # ep's experts as slices of the whole weights, through ZeRO-1's shards of them and
    # of the other weights, and back
    "ep": (
        2,
        (
            (2, {"ep": 2, "dp": 1}),
            (1, {"ep": 1, "dp": 2}),
            (1, {"ep": 2, "dp": 1, "zero": 1}),
            (1, {"ep": 2, "dp": 1}),
        ),
    ),
    # under ep × tp a rank holds its tp slice of its run of experts
    "ep×tp": (
        4,
        (
            (2, {"ep": 2, "tp": 2, "dp": 1}),
            (1, {"ep": 1, "tp": 1, "dp": 4}),
            (1, {"ep": 2, "tp": 2, "dp": 1, "zero": 1}),
            # ZeRO-3's buckets over their own groups: the experts' over dp, the rest's
            # over dp × ep
            (1, {"ep": 2, "dp": 2, "zero": 3}),
            (1, {"ep": 2, "tp": 2, "dp": 1, "zero": 3}),
        ),
    ),
}


def _resume(batch, directory, plans) -> list[float]:
    losses: list[float] = []
    for i, (steps, pins) in enumerate(plans):
        pm = parallelize_lm(tiny_mixtral(), batch, "adamw", **{"tp": 1, "cp": 1, "pp": 1, **pins})
        if i:
            autopart.load_checkpoint(pm, directory)
        losses += train_losses(pm, batch, steps)
        autopart.save_checkpoint(pm, directory)
        pm.close()
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("case", RESUMED)
def test_a_checkpoint_moves_between_expert_and_data_parallel_plans(case, tmp_path):
    """The experts each rank holds are saved as their boxes of the whole weights, and
    read back as a dp plan's whole weights, and back: the resumed runs follow one
    device's losses."""
    world, plans = RESUMED[case]
    batch = token_batch(8)
    steps = sum(n for n, _ in plans)
    reference = train_reference(tiny_mixtral(), "adamw", steps, (batch[0],), batch[1])
    for losses in run_world(_resume, world, batch, str(tmp_path), plans):
        assert losses == pytest.approx(reference["losses"], rel=1e-5)


def test_a_load_balancing_loss_is_taken_over_the_whole_batch_or_per_part_as_asked():
    """The load-balancing loss multiplies two statistics of the whole batch (token
    fractions, router probabilities): split over dp or ep, each replica takes their
    mean over the replicas (passes/batch_statistics.py), exact, but microbatches within
    a replica would see their own part alone, and are refused. Per-part statistics
    (Megatron-LM's) are the user's choice, which the plan then states."""
    ids, _ = token_batch(8)
    captured = captured_for_planning(tiny_mixtral(router_loss=True), (ids,), repeated_once=True)
    plan = functools.partial(make_plan, captured, TWO_CPUS)  # one capture, planned 4 ways
    for pins in ({"dp": 2}, {"ep": 2}):
        assert plan(Pins.of(**pins)).degrees.batch_split == 2
    with pytest.raises(autopart.PlanError, match="combines statistics over the batch"):
        plan(Pins.of(dp=2, microbatches=2))
    accepted = plan(Pins.of(dp=2, per_part_statistics=True))
    assert accepted.dp == 2 and "per_part_statistics=True" in accepted.explain()


ZOO_MOE = ("qwen2_moe", "olmoe")


def _zoo(name: str):
    from tests import zoo_models

    torch.manual_seed(0)
    return getattr(zoo_models, name)()


def _train_zoo(batch) -> dict:
    return {name: train_case(_zoo(name), batch, STEPS, tp=1, cp=1, pp=1, ep=2) for name in ZOO_MOE}


@pytest.mark.slow
def test_other_mixtures_of_experts_train_like_one_device_under_ep():
    """Qwen2-MoE (routed experts beside a gated shared expert) and OLMoE at ep=2."""
    batch = token_batch(8)
    per_rank = run_world(_train_zoo, 2, batch)
    for name in ZOO_MOE:
        reference = train_reference(_zoo(name), "adamw", STEPS, (batch[0],), batch[1])
        assert_every_rank_matches(per_rank, name, reference, label=name)


def _train_router_loss(batch, pins) -> dict:
    ids, target = batch
    pm = autopart.parallelize(
        tiny_mixtral(router_loss=True),
        autopart.Mesh.local(),
        (ids,),
        loss_fn=lm_and_router_loss,
        optimizer=make_optimizer("adamw"),
        **{"tp": 1, "cp": 1, "pp": 1, **pins},
    )
    result = {"losses": train_losses(pm, batch, STEPS), "params": pm.full_state_dict()}
    pm.close()
    return result


def _per_part_reference(batch) -> dict:
    """One device, each half of the batch taking its own load-balancing loss."""
    model = tiny_mixtral(router_loss=True)
    optimizer = make_optimizer("adamw")(model.parameters())
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        halves = zip(*(t.chunk(2) for t in batch))
        loss = sum(lm_and_router_loss(model(ids), target) for ids, target in halves) / 2
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "params": snapshot(model)}


@pytest.mark.slow
@pytest.mark.parametrize("pins", [{"dp": 2, "ep": 1}, {"dp": 1, "ep": 2}], ids=str)
def test_per_part_statistics_take_each_part_s_own_load_balancing_loss(pins):
    batch = token_batch(8)
    reference = _per_part_reference(batch)
    for result in run_world(_train_router_loss, 2, batch, {**pins, "per_part_statistics": True}):
        assert_matches(result, reference)


@pytest.mark.slow
@pytest.mark.parametrize("pins", [{"dp": 2, "ep": 1}, {"dp": 1, "ep": 2}], ids=["dp2", "ep2"])
def test_a_load_balancing_loss_trains_like_one_device_under_a_split_of_the_batch(pins):
    """Mixtral's `output_router_logits=True`: its token fractions and mean router
    probabilities are the mean of the replicas' (passes/batch_statistics.py), so the
    loss, and training, are one device's."""
    batch = token_batch(8)
    model = tiny_mixtral(router_loss=True)
    want = train_reference(model, "adamw", STEPS, batch[:1], batch[1], lm_and_router_loss)
    for result in run_world(_train_router_loss, 2, batch, pins):
        diff = max(abs(g - w) / w for g, w in zip(result["losses"], want["losses"], strict=True))
        print(f"{pins}: losses within {diff:.1e} of one device")
        assert_matches(result, want, rtol=1e-5)


@pytest.mark.slow
def test_a_load_balancing_loss_trains_like_one_device_under_context_parallelism():
    """cp=2 splits the sequence, not the batch: the routed layers gather the whole
    sequence and run whole on every cp rank, so the load-balancing loss's token
    fractions and router probabilities are the whole batch's, exact, not per part."""
    batch = token_batch(8)
    model = tiny_mixtral(router_loss=True)
    want = train_reference(model, "adamw", STEPS, batch[:1], batch[1], lm_and_router_loss)
    ids = batch[0]
    plan = autopart.plan(tiny_mixtral(router_loss=True), TWO_CPUS, (ids,), cp=2)
    assert plan.cp == 2 and not plan.per_part_statistics
    assert "per_part_statistics" not in plan.explain()
    for result in run_world(_train_router_loss, 2, batch, {"cp": 2}):
        assert_matches(result, want, rtol=1e-5)
