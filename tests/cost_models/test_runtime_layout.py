"""Predictions follow what the runtime will run: the plan's tensor-parallel placements
(a replicated LM head stays whole, a column-parallel product saves its whole input),
ZeRO-3's bucket-by-bucket collectives and ZeRO's flat-shard optimizer."""

from __future__ import annotations

from dataclasses import replace

import pytest
from torch.distributed.tensor import Shard

from autopart.capture import capture
from autopart.cost_models.predict import Choices, predict
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


def test_zero3_on_gloo_prices_what_its_collectives_add_issued_ahead_of_compute(gpt2):
    """A profile that measured the collectives issued ahead of compute (a CPU's): the
    first gather of each pass and the last reduce-scatter wait after compute and cost
    their whole second; the other four gathers of each pass and four reduce-scatters
    were issued ahead and cost what that adds, a quarter."""
    slow = {"alpha": 1.0, "beta": 1e-15, "ahead_alpha": 0.25, "ahead_beta": 1e-15}
    spec = replace(PRESETS["cpu"], collectives={"all_gather": slow, "reduce_scatter": slow})
    mesh = Mesh(spec, nodes=1, per_node=2, backend="gloo")  # a running Gloo world
    zero2, zero3 = (
        predict(gpt2.gm, mesh, Choices(global_batch=8, zero=z, degrees=Degrees(dp=2)))
        for z in (2, 3)
    )
    assert zero3.exposed_comm_s - zero2.exposed_comm_s == pytest.approx(3 + 12 / 4 - 2, abs=0.01)


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
