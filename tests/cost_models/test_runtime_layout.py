"""Predictions follow what the runtime will run: the plan's tensor-parallel placements
(a replicated LM head stays whole, a column-parallel product saves its whole input),
ZeRO-3's bucket-by-bucket collectives and ZeRO's flat-shard optimizer."""

from __future__ import annotations

from dataclasses import replace

import pytest
from torch.distributed.tensor import Shard

from autopart.capture import capture
from autopart.cost_models.choices import Choices
from autopart.cost_models.predict import predict
from autopart.cost_models.summary import GraphSummary, TpLayout
from autopart.degrees import Degrees
from autopart.mesh import PRESETS, Mesh
from autopart.ops.aten import op_name
from autopart.passes import MODULE_PATH, analyze
from autopart.solver.pins import Pins, make_plan
from tests.models import tiny_gpt2, tiny_mixtral, token_batch


@pytest.fixture(scope="module")
def gpt2():
    captured = capture(tiny_gpt2(), (token_batch(batch=8)[0],))
    analyze(captured.gm, captured.context())
    return captured


def test_tensor_parallel_parameters_are_those_the_placements_shard(gpt2):
    mesh = Mesh.cluster("cpu", nodes=1, per_node=2)
    plan = make_plan(gpt2, mesh, Pins.of(tp=2))
    held = sum(
        p.numel() / (2 if isinstance(plan.placement(fqn, "tp"), Shard) else 1)
        for fqn, p in gpt2.gm.named_parameters()
    )
    assert plan.predicted.memory["parameters"] == pytest.approx(4 * held)
    megatron = predict(gpt2.gm, mesh, replace(Choices.of(plan), tp_placements=None))
    assert megatron.memory["parameters"] < plan.predicted.memory["parameters"]


def test_column_parallel_products_save_their_whole_input(gpt2):
    plan = make_plan(gpt2, Mesh.cluster("cpu", nodes=1, per_node=2), Pins.of(tp=2))
    layout = Choices.of(plan).tp_layout(gpt2.gm)
    column = _node(gpt2.gm, "transformer.h.0.attn.c_attn", "addmm")
    row = _node(gpt2.gm, "transformer.h.0.attn.c_proj", "addmm")
    norm = _node(gpt2.gm, "transformer.h.0.ln_1", "layer_norm")
    assert column in layout.split and column in layout.saves_replicated
    assert row in layout.split and row not in layout.saves_replicated
    assert norm not in layout.split
    sharded = GraphSummary(gpt2.gm, layout).evaluate({"batch": 8})
    megatron = GraphSummary(gpt2.gm).evaluate({"batch": 8})
    saved = [sum(s.sharded(2).saved_bytes() for s in g) for g in (sharded, megatron)]
    assert saved[0] > saved[1]


def test_zero3_pays_a_gather_per_bucket_in_each_pass_and_the_last_scatter(gpt2):
    # Collectives of one second and no bandwidth cost: nothing hides behind compute.
    slow = {"alpha": 1.0, "beta": 1e-15}
    spec = replace(PRESETS["cpu"], collectives={"all_gather": slow, "reduce_scatter": slow})
    mesh = Mesh.cluster(spec, nodes=1, per_node=2)
    zero2, zero3 = (
        predict(gpt2.gm, mesh, Choices(global_batch=8, zero=z, degrees=Degrees(dp=2)))
        for z in (2, 3)
    )
    layout = TpLayout.of(gpt2.gm, {}, tp=1)
    assert not layout.split
    # The embeddings, two blocks and the final norm: four buckets, and the tied head
    # gathers the embeddings' again, as the runtime does (tests/runtime/test_zero.py):
    # five gathers in forward and in backward, five reduce-scatters in backward (one
    # ring step each over two ranks).
    assert zero3.exposed_comm_s - zero2.exposed_comm_s == pytest.approx(5 + 5 + 5 - 2, abs=0.01)


def test_zero3_on_a_measured_cpu_prices_each_bucket_as_the_profile_measured_it(gpt2):
    """A profile that measured what a ZeRO-3 bucket's collectives add run together (a
    CPU's, `autopart calibrate`): each of the five gathers of a pass (four buckets and
    the tied head's second gather of the embeddings) costs that, 3 s a ring step plus
    a second per KiB sent, whatever its collectives cost alone."""
    slow = {"alpha": 1.0, "beta": 1e-15}
    spec = replace(
        PRESETS["cpu"],
        collectives={"all_gather": slow, "reduce_scatter": slow},
        zero3_bucket={"alpha": 3.0, "beta": 1 / 1024},
    )
    mesh = Mesh(spec, nodes=1, per_node=2, backend="gloo")  # a running Gloo world
    choices = Choices(global_batch=8, zero=3, degrees=Degrees(dp=2))
    zero2, zero3 = (predict(gpt2.gm, mesh, replace(choices, zero=z)) for z in (2, 3))
    embeddings = sum(p.numel() for n, p in gpt2.gm.named_parameters() if "wte" in n or "wpe" in n)
    gathered = sum(p.numel() for p in gpt2.gm.parameters()) + embeddings  # elements
    # fp32 weights and gradients: 4 bytes a gathered element; half of it sent on 2 ranks.
    expected = 5 * 3.0 + gathered * 4 / 2 / 1024
    assert zero3.exposed_comm_s - zero2.exposed_comm_s == pytest.approx(expected - 2, rel=1e-3)


def _node(gm, path: str, op: str):
    return next(n for n in gm.graph.nodes if MODULE_PATH.get(n) == path and op_name(n, gm) == op)


@pytest.mark.parametrize(
    ("degrees", "seconds"), [(Degrees(dp=2, ep=2), 42), (Degrees(ep=2, tp=2), 12)]
)
def test_zero3_under_ep_gathers_the_experts_over_dp_and_the_rest_over_dp_and_ep(degrees, seconds):
    """Tiny Mixtral's other weights in four buckets (embeddings, two layers, the norm and
    head), each layer's experts in a bucket of their own (`passes/zero.py`): gathered in
    each pass and reduce-scattered, the rest over dp × ep (3 ring steps over 4 ranks, 1
    over 2), the experts over their dp replicas (1 step over 2; with dp = 1 they stay
    whole). One second a ring step."""
    captured = capture(tiny_mixtral(), (token_batch(batch=8)[0],))
    analyze(captured.gm, captured.context())
    slow = {"alpha": 1.0, "beta": 1e-15}
    spec = replace(PRESETS["cpu"], collectives={"all_gather": slow, "reduce_scatter": slow})
    mesh = Mesh.cluster(spec, nodes=1, per_node=4)
    zero0, zero3 = (
        predict(captured.gm, mesh, Choices(global_batch=8, zero=z, degrees=degrees)) for z in (0, 3)
    )
    assert zero3.exposed_comm_s - zero0.exposed_comm_s == pytest.approx(seconds, abs=0.05)


def test_local_sgd_under_ep_syncs_each_replica_every_step_and_averages_replicas_every_h():
    """A local SGD replica is an ep group: every step its ranks all-reduce the other
    weights' gradients, as plain ep=2 does with one replica; every h steps the dp
    replicas average every parameter (one all-reduce over 2 ranks: 2 ring steps of one
    second, amortized over h steps)."""
    captured = capture(tiny_mixtral(), (token_batch(batch=8)[0],))
    analyze(captured.gm, captured.context())
    spec = replace(PRESETS["cpu"], collectives={"all_reduce": {"alpha": 1.0, "beta": 1e-15}})

    def exposed(per_node: int, dp: int, sync_every: int | None) -> float:
        choices = Choices(global_batch=8, degrees=Degrees(dp=dp, ep=2), sync_every=sync_every)
        mesh = Mesh.cluster(spec, nodes=1, per_node=per_node)
        return predict(captured.gm, mesh, choices).exposed_comm_s

    # One replica: its ranks' sync every step is plain ep's (a bucket of 2 ring steps).
    assert exposed(2, 1, 2) == pytest.approx(exposed(2, 1, None), abs=0.05)
    # Over dp's 2 ranks, not dp × ep's 4 (6 ring steps, which would make this 3).
    assert exposed(4, 2, 1) - exposed(4, 2, 2) == pytest.approx(1, abs=0.05)
    # Every 2 steps, what plain dp × ep syncs every step (and the experts over dp).
    assert exposed(4, 2, 2) < exposed(4, 2, None)
