"""Tensor parallelism: the layouts chosen, the per-rank graph, and the numerics of
TP2, TP4 and DP2×TP2 against one device (fp32, 5 AdamW steps, Gloo)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import autopart
from autopart.capture import capture
from autopart.ops.aten import op_name
from autopart.passes import analyze
from autopart.passes.tp_decision import argument_leaves, flatten_args
from autopart.passes.tp_propagate import gradient_flow, operands_of, propagate
from autopart.passes.tp_rules import decide
from autopart.solver.tensor_parallel import choose_tp_placements
from autopart.testing import run_world
from tests.harness import assert_every_rank_matches, case_key, train_case
from tests.models import (
    LM_FACTORIES,
    assert_matches,
    make_optimizer,
    snapshot,
    tiny_gpt2,
    tiny_llama,
    token_batch,
    train_reference,
    train_single_device,
)

STEPS = 5


def _placements(model, tp):
    captured = capture(model, (token_batch(4)[0],))
    analyze(captured.gm, captured.context())
    names = captured.parameter_names
    places = choose_tp_placements(captured.gm, names, tp)
    return places, propagate(captured.gm, names, places, tp)


def test_gpt2_gets_megatron_layout_with_fused_qkv():
    places, result = _placements(tiny_gpt2(), 2)
    for i in range(2):
        h = f"transformer.h.{i}"
        assert places[f"{h}.attn.c_attn.weight"] == Shard(1)  # Conv1D weight is [in, out]
        assert places[f"{h}.attn.c_proj.weight"] == Shard(0)
        assert places[f"{h}.mlp.c_fc.weight"] == Shard(1)
        assert places[f"{h}.mlp.c_proj.weight"] == Shard(0)
        assert f"{h}.attn.c_proj.bias" not in places  # added once, after the reduction
        assert result.fused[f"{h}.attn.c_attn.weight"] == 3  # q, k, v sharded part by part
    assert "transformer.wte.weight" not in places
    assert result.fallbacks == []


class _Gated(nn.Module):
    """A fused gate and up projection, its bias (if any) added after the product, as
    expert layers add theirs after a grouped multiply."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(16, 8))
        self.bias = nn.Parameter(torch.randn(16)) if bias else None
        self.down = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        h = x @ self.gate_up.t()
        gate, up = (h if self.bias is None else h + self.bias).chunk(2, dim=-1)
        return self.down(torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("bias", [False, True])
def test_a_split_into_parts_is_local_only_where_its_weight_is_cut_part_by_part(bias):
    """A column-parallel product split into parts (gate, up) runs locally only where the
    weight is known to be fused, and is cut part by part; a bias added in between hides
    which weight made the dim, so the split gathers it rather than pair wrong parts."""
    captured = capture(_Gated(bias), (torch.randn(4, 8),))
    analyze(captured.gm, captured.context())
    places = {"gate_up": Shard(0), "down.weight": Shard(1)}
    if bias:
        places["bias"] = Shard(0)
    result = propagate(captured.gm, captured.parameter_names, places, 2)
    splits = [n for n in captured.gm.graph.nodes if op_name(n) in ("chunk", "split")]
    assert splits
    if bias:
        assert "gate_up" not in result.fused
        assert all(result.decisions[n].fallback for n in splits)
    else:
        assert result.fused == {"gate_up": 2}
        assert not any(result.decisions[n].fallback for n in splits)


def test_llama_attention_stays_whole_when_kv_heads_do_not_divide():
    places, result = _placements(tiny_llama(), 4)  # 2 kv heads cannot split 4 ways
    assert places["model.layers.0.mlp.gate_proj.weight"] == Shard(0)
    assert places["model.layers.0.mlp.down_proj.weight"] == Shard(1)
    assert "model.layers.0.self_attn.q_proj.weight" not in places
    assert result.fallbacks == []
    places, _ = _placements(tiny_llama(), 2)
    assert places["model.layers.1.self_attn.k_proj.weight"] == Shard(0)
    assert places["model.layers.1.self_attn.o_proj.weight"] == Shard(1)


def _collectives_and_local_size(pm) -> dict:
    return {
        "collectives": [(kind.kind, kind.axis) for _, kind in pm.collectives()],
        "local_numel": sum(p.numel() for p in pm.parameters()),
    }


def _train(cases, batch):
    return {
        case_key(model_name, pins): train_case(
            LM_FACTORIES[model_name](),
            batch,
            STEPS,
            inspect=_collectives_and_local_size,
            **pins,
        )
        for model_name, pins in cases
    }


@pytest.mark.parametrize(
    "world, pins",
    [(2, [{"tp": 2}]), pytest.param(4, [{"tp": 4}, {"dp": 2, "tp": 2}], marks=pytest.mark.slow)],
    ids=["tp2", "tp4-dp2tp2"],
)
def test_tensor_parallel_matches_single_device(world, pins):
    cases = [(m, p) for m in ("gpt2", "llama") for p in pins]
    batch = token_batch(batch=8)
    per_rank = run_world(_train, world, cases, batch)
    for model_name in ("gpt2", "llama"):
        reference = train_single_device(model_name, "adamw", STEPS, batch)
        full = sum(v.numel() for v in reference["params"].values())
        for p in pins:
            key = case_key(model_name, p)
            assert_every_rank_matches(per_rank, key, reference)
            result = per_rank[0][key]
            assert result["local_numel"] < full  # this rank holds only its shards
            kinds = {k for k, _ in result["collectives"]}
            assert {"all_reduce", "all_reduce (backward)"} <= kinds
            assert {axis for _, axis in result["collectives"]} == {"tp"}


# Operators autopart has no rule for, between a column- and a row-parallel linear: a
# cumulative sum over the sharded features (DTensor's strategy replicates it too, so it
# falls back), and over the rows or a sort of them (DTensor's strategies keep the
# feature shards).
MIXES = {
    "cumsum_features": lambda h: torch.cumsum(h, dim=-1),
    "cumsum_rows": lambda h: torch.cumsum(h, dim=0),
    "sort_rows": lambda h: torch.sort(h, dim=0).values,
}


class MixMLP(nn.Module):
    def __init__(self, mix: str):
        super().__init__()
        torch.manual_seed(0)
        self.mix = MIXES[mix]
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        return self.down(self.mix(torch.relu(self.up(x))))


def _forced_layout(mix, x, target):
    model = MixMLP(mix)
    mesh = autopart.Mesh.local()
    plan = autopart.plan(model, mesh, (x,), tp=2)
    forced = dict(plan.placements)  # column-parallel up, row-parallel down: the mix between
    forced.update(
        {
            "up.weight": (Replicate(), Shard(0)),
            "up.bias": (Replicate(), Shard(0)),
            "down.weight": (Replicate(), Shard(1)),
        }
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = autopart.parallelize(
            model,
            mesh,
            (x,),
            plan=plan.with_changes(placements=forced),
            loss_fn=torch.nn.functional.mse_loss,
            optimizer=make_optimizer("sgd"),
        )
    losses = [pm.train_step(x, target).item() for _ in range(3)]
    kinds = sorted(info.kind for _, info in pm.collectives())
    params = pm.full_state_dict()
    pm.close()
    return losses, params, [str(w.message) for w in caught], kinds


def _forced_layouts(x, target):
    return {mix: _forced_layout(mix, x, target) for mix in MIXES}


MIX_BATCH = tuple(torch.randn(4, 8, generator=torch.Generator().manual_seed(k)) for k in (0, 1))


@pytest.fixture(scope="module")
def mixed():
    """Every mix trained in one world of 2 (rank 0's results)."""
    return run_world(_forced_layouts, 2, *MIX_BATCH)[0]


def _assert_trains_like_one_device(mix, x, target, losses, params):
    model = MixMLP(mix)
    opt = make_optimizer("sgd")(model.parameters())
    for step in range(3):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        assert losses[step] == pytest.approx(loss.item(), rel=1e-5)
    assert_matches({"losses": [], "params": params}, {"losses": [], "params": snapshot(model)})


def test_an_op_without_a_rule_falls_back_to_replication_and_stays_correct(mixed):
    x, target = MIX_BATCH
    losses, params, messages, kinds = mixed["cumsum_features"]
    assert any("cumsum" in m and "replicates" in m for m in messages)
    assert "all_gather" in kinds
    _assert_trains_like_one_device("cumsum_features", x, target, losses, params)


@pytest.mark.parametrize("mix", ["cumsum_rows", "sort_rows"])
def test_an_op_without_a_rule_takes_dtensors_strategy_and_stays_sharded(mixed, mix):
    """cumsum and sort have no autopart rule; DTensor's registered strategies keep them
    on the feature shards, so nothing is gathered between the two linears."""
    x, target = MIX_BATCH
    losses, params, messages, kinds = mixed[mix]
    assert not [m for m in messages if "replicates" in m]
    assert "all_gather" not in kinds
    assert kinds.count("all_reduce") == 1  # the row-parallel product's partial sums
    _assert_trains_like_one_device(mix, x, target, losses, params)


def _train_sequence_parallel(batch):
    """Sequence parallelism under the solver's own layout (its vocabulary-parallel
    embedding's partial sums reduce-scattered along the sequence) and under Megatron's
    (the pattern generator's)."""
    ids, _ = batch
    mesh = autopart.Mesh.local()
    plan = autopart.plan(tiny_llama(), mesh, (ids,), tp=2, sequence_parallel=True)
    places, _ = _placements(tiny_llama(), 2)
    megatron = {fqn: (Replicate(), places.get(fqn, Replicate())) for fqn in plan.placements}
    return {
        name: train_case(
            tiny_llama(), batch, STEPS, inspect=_collectives_and_local_size, plan=chosen
        )
        for name, chosen in (("solver", plan), ("megatron", plan.with_changes(placements=megatron)))
    }


@pytest.mark.slow  # tp2 is checked quick; sequence parallelism in the slow sweeps
def test_sequence_parallel_matches_single_device_and_reduce_scatters():
    batch = token_batch(batch=8)
    results = run_world(_train_sequence_parallel, 2, batch)[0]
    reference = train_single_device("llama", "adamw", STEPS, batch)
    for name, result in results.items():
        assert_matches(result, reference)
        kinds = [k for k, _ in result["collectives"]]
        assert "reduce_scatter" in kinds, name
    # Megatron's layout replicates the embedding: nothing is all-reduced. The solver's
    # shards it over the vocabulary, and its lookup's partial sums are reduce-scattered.
    assert "all_reduce" not in [k for k, _ in results["megatron"]["collectives"]]
    assert results["solver"]["local_numel"] < results["megatron"]["local_numel"]


@pytest.mark.parametrize("factory", [tiny_gpt2, tiny_llama])
def test_the_fast_argument_walk_sees_what_pytree_sees(factory):
    """The propagation's `argument_leaves` must give the operands in the order the
    rewrite's `flatten_args` (pytree) numbers them: a decision about operand i is
    applied to operand i."""
    captured = capture(factory(), (token_batch(8)[0],))
    for node in captured.gm.graph.nodes:
        expected = flatten_args(node)[0]
        leaves = argument_leaves(node)
        assert len(leaves) == len(expected), node
        assert all(a is b or a == b for a, b in zip(leaves, expected)), node


def _train_vocabulary_parallel(batch, pins):
    """The solver's plan with the embedding table and the LM head sharded over the
    vocabulary: a masked lookup whose partial sums are all-reduced, and a
    column-parallel head whose logits are gathered for the loss."""
    ids, _ = batch
    plan = autopart.plan(tiny_llama(), autopart.Mesh.local(), (ids,), **pins)
    placements = dict(plan.placements)
    for fqn in ("model.embed_tokens.weight", "lm_head.weight"):
        placements[fqn] = (placements[fqn][0], Shard(0))
    # The head reads the final norm's output whole: a sharded norm would make the
    # rewrite gather the head's weight instead.
    placements["model.norm.weight"] = (placements["model.norm.weight"][0], Replicate())
    plan = plan.with_changes(placements=placements)

    def lookups(pm):
        nodes = list(pm.graph.graph.nodes)
        return {
            "vocab_parallel": any("vocab_parallel_embedding" in str(n.target) for n in nodes),
            "head_gathered": any("all_gather_lm_head_weight" in n.name for n in nodes),
        }

    return train_case(tiny_llama(), batch, STEPS, inspect=lookups, plan=plan)


@pytest.mark.slow  # the vocabulary-parallel loss at tp=2 is checked quick
@pytest.mark.parametrize(
    "world, pins", [(2, {"tp": 2}), pytest.param(4, {"dp": 2, "tp": 2}, marks=pytest.mark.slow)]
)
def test_vocabulary_parallel_embedding_and_head_match_single_device(world, pins):
    batch = token_batch(batch=8)
    per_rank = run_world(_train_vocabulary_parallel, world, batch, pins)
    reference = train_single_device("llama", "adamw", STEPS, batch)
    for rank, result in enumerate(per_rank):
        assert result.pop("vocab_parallel"), rank
        assert not result.pop("head_gathered"), rank  # the head's weight stays sharded
        assert_matches(result, reference)


def _train_padded_vocabulary(batch):
    """A table with a padding row at index 0, pinned to shard over the vocabulary: the
    masked lookup would lose the padding row's zero gradient, so the rule gathers the
    table for a whole lookup instead (index 0 once passed for `False`, crashing it)."""
    ids, _ = batch
    model = tiny_llama(pad_token_id=0)
    plan = autopart.plan(model, autopart.Mesh.local(), (ids,), tp=2)
    placements = dict(plan.placements)
    fqn = "model.embed_tokens.weight"
    placements[fqn] = (placements[fqn][0], Shard(0))
    plan = plan.with_changes(placements=placements)

    def lookups(pm):
        ops = {str(n.target) for n in pm.graph.graph.nodes}
        return {"vocab_parallel": any("vocab_parallel_embedding" in op for op in ops)}

    return train_case(model, batch, STEPS, inspect=lookups, plan=plan)


@pytest.mark.slow  # another world of 2
def test_a_padding_row_keeps_the_embedding_lookup_whole():
    batch = token_batch(batch=8)
    per_rank = run_world(_train_padded_vocabulary, 2, batch)
    model = tiny_llama(pad_token_id=0)
    reference = train_reference(model, "adamw", STEPS, (batch[0],), batch[1])
    for rank, result in enumerate(per_rank):
        assert not result.pop("vocab_parallel"), rank
        assert_matches(result, reference)


class Reshaped(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


@pytest.mark.parametrize(
    "fn, shape, place, want",
    [
        (lambda x: x.flatten(2), (4, 6, 2, 2), Shard(0), Shard(0)),  # a batch shard stays
        (lambda x: x.flatten(2), (4, 6, 2, 2), Shard(1), Shard(1)),
        (lambda x: x.flatten(1), (4, 6, 2, 2), Shard(1), Shard(1)),  # outermost of the merge
        (lambda x: x.flatten(1), (4, 6, 2, 2), Shard(2), None),  # inside it: gathered
        (lambda x: x.flatten(0, 1), (4, 6, 2, 2), Shard(3), Shard(2)),
        (lambda x: x.unflatten(2, (4, 2)), (4, 6, 8), Shard(0), Shard(0)),
        (lambda x: x.unflatten(1, (3, 2)), (4, 6, 8), Shard(2), Shard(3)),
        (lambda x: x.unflatten(2, (4, 2)), (4, 6, 8), Shard(2), Shard(2)),  # heads split
    ],
)
def test_flatten_and_unflatten_move_the_shard_with_its_dim(fn, shape, place, want):
    """Ranks change through (un)flatten, so the shard follows its dim, not the right
    edge as an elementwise operator's would."""
    captured = capture(Reshaped(fn), (torch.randn(*shape),))
    analyze(captured.gm, captured.context())
    gm = captured.gm
    node = next(n for n in gm.graph.nodes if op_name(n, gm) in ("flatten", "unflatten"))
    ops = operands_of(node, {node.all_input_nodes[0]: place}, gradient_flow(gm, {}), 2)
    decision = decide(ops, gm)
    if want is None:
        assert decision.fallback and decision.output == Replicate()
        return
    assert not decision.fallback and decision.output == want
    local = torch.randn(*shape).tensor_split(2, place.dim)[0]
    if decision.updates:  # the split's sizes are local
        ((leaf, size),) = decision.updates.items()
        assert (leaf, size) == (2, 2)
        local_out = local.unflatten(2, (2, 2))
    else:
        local_out = fn(local)
    whole = fn(torch.randn(*shape))
    assert local_out.shape[want.dim] * 2 == whole.shape[want.dim]
