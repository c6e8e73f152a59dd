"""Context parallelism trains a causal Llama (sequence 64) like one device: cp=2 on 2
Gloo ranks; cp=2 × dp=2 (with ZeRO-0, 1 and 3), cp=2 × tp=2, with sequence
parallelism, and cp=2 × pp=2 (1F1B) on 4; 3 AdamW steps in fp32, every rank's losses
and parameters within 1e-5 of one device's. Each layer's attention runs as a ring, and
the only gather of the sequence is the logits'. Under plain data parallelism the
weights' gradients are summed over cp by the data-parallel sync (no all-reduce in
backward); under ZeRO, in backward."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard

import autopart
from autopart.capture import capture
from autopart.ops.aten import op_name
from autopart.passes import analyze
from autopart.passes.context_parallel import sequence_inputs
from autopart.passes.tp_propagate import propagate
from autopart.testing import run_world
from tests.harness import (
    assert_every_rank_matches,
    case_key,
    parallelize_lm,
    train_case,
    train_losses,
)
from tests.models import VOCAB, tiny_gpt2, tiny_llama, token_batch, train_reference

STEPS = 3
SEQ = 64
PARAMETERS = len(list(tiny_llama().parameters()))
CASES = {
    2: [{"cp": 2, "dp": 1, "tp": 1}],
    4: [
        {"cp": 2, "dp": 2, "tp": 1, "zero": 0},
        {"cp": 2, "dp": 2, "tp": 1, "zero": 1},
        {"cp": 2, "dp": 2, "tp": 1, "zero": 3},
        {"cp": 2, "dp": 1, "tp": 2},
        {"cp": 2, "dp": 1, "tp": 2, "sequence_parallel": True},
        {"cp": 2, "dp": 1, "tp": 1, "pp": 2, "schedule": "1f1b", "microbatches": 2},
    ],
}


def _graph_of(pm) -> dict:
    nodes = [n for stage in pm._stage_graphs() for n in stage.graph.nodes]
    targets = Counter(getattr(n.target, "__name__", str(n.target)) for n in nodes)
    kinds = Counter((info.axis, info.kind) for _, info in pm.collectives())
    return {"rings": targets["ring_attention"], "kinds": kinds, "summed": len(pm.cp_summed)}


def _train(batch, cases) -> dict:
    return {
        case_key("llama", pins): train_case(
            tiny_llama(), batch, STEPS, inspect=_graph_of, **{"pp": 1, **pins}
        )
        for pins in cases
    }


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_context_parallel_trains_like_one_device(world):
    batch = token_batch(4, SEQ)
    reference = train_reference(tiny_llama(), "adamw", STEPS, (batch[0],), batch[1])
    per_rank = run_world(_train, world, batch, CASES[world])
    for pins in CASES[world]:
        key = case_key("llama", pins)
        assert_every_rank_matches(per_rank, key, reference, label=pins)
        graphs = [r[key] for r in per_rank]
        pipelines = world // pins.get("pp", 1)  # ranks that hold every stage between them
        # Both layers' attention as rings; the logits gathered for the loss, once.
        assert sum(g["rings"] for g in graphs) == 2 * pipelines
        assert sum(g["kinds"][("cp", "all_gather")] for g in graphs) == pipelines
        in_backward = sum(g["kinds"][("cp", "all_reduce (backward)")] for g in graphs)
        summed = sum(g["summed"] for g in graphs)
        if pins.get("zero"):
            assert in_backward > 0 and summed == 0
        elif pins["tp"] == 1:  # every weight of the Llama reads this rank's tokens alone
            assert in_backward == 0 and summed == PARAMETERS * world


def _train_gpt2(batch) -> dict:
    return train_case(tiny_gpt2(), batch, STEPS, inspect=_graph_of, cp=2, dp=1, tp=1, pp=1)


def test_one_sequence_through_gpt2s_flattening_projections_stays_sharded():
    """GPT-2's Conv1D flattens [batch, seq, h] into rows for its product and back. With
    one sequence a batch dim of 1 holds nothing, so the rows stay this rank's tokens:
    no gather around the projections, the logits' gather for the loss alone."""
    batch = token_batch(1, SEQ)
    reference = train_reference(tiny_gpt2(), "adamw", STEPS, (batch[0],), batch[1])
    per_rank = run_world(_train_gpt2, 2, batch)
    assert_every_rank_matches([{"gpt2": r} for r in per_rank], "gpt2", reference)
    for graph in per_rank:
        assert graph["rings"] == 2
        assert graph["kinds"][("cp", "all_gather")] == 1


def _resume(batch, directory) -> list[float]:
    pm = parallelize_lm(tiny_llama(), batch, "adamw", cp=2, dp=2, tp=1, pp=1, zero=0)
    losses = train_losses(pm, batch, STEPS - 1)
    autopart.save_checkpoint(pm, directory)
    pm.close()
    pm = parallelize_lm(tiny_llama(), batch, "adamw", cp=1, dp=4, tp=1, pp=1, zero=1)
    autopart.load_checkpoint(pm, directory)
    losses += train_losses(pm, batch, 1)
    pm.close()
    return losses


@pytest.mark.slow
def test_a_checkpoint_of_a_context_parallel_plan_resumes_under_data_parallelism(tmp_path):
    """Parameters replicated over cp are saved once and read back under another plan:
    the resumed run follows one device's losses."""
    batch = token_batch(4, SEQ)
    reference = train_reference(tiny_llama(), "adamw", STEPS, (batch[0],), batch[1])
    for losses in run_world(_resume, 4, batch, str(tmp_path)):
        assert losses == pytest.approx(reference["losses"], rel=1e-5)


# -- attention written as models write it ---------------------------------------------

# How `ViewsAttentionLM` calls scaled_dot_product_attention: `is_causal=True` (captured
# as the positional (q, k, v, None, 0.0, True)), the positional form written out, with
# a scale, and unmasked (every token attends to every other).
ATTENTION_FORMS = ("causal", "positional", "scaled", "unmasked")


class ViewsAttentionLM(nn.Module):
    """A Llama-like causal language model whose q, k and v are views: heads transposed
    out of [batch, seq, heads, head_dim], never made contiguous (ring attention passes
    such keys and values round the ring)."""

    def __init__(self, form: str, width: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.form, self.heads = form, heads
        self.embed = nn.Embedding(VOCAB, width)
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(layers))
        self.qkv = nn.ModuleList(nn.Linear(width, 3 * width) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.head = nn.Linear(width, VOCAB)

    def _attend(self, q, k, v):
        if self.form == "causal":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if self.form == "positional":
            return F.scaled_dot_product_attention(q, k, v, None, 0.0, True)
        if self.form == "scaled":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
        return F.scaled_dot_product_attention(q, k, v)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        b, s, w = x.shape
        for norm, qkv, out in zip(self.norms, self.qkv, self.out):
            parts = qkv(norm(x)).split(w, dim=-1)
            q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in parts)
            x = x + out(self._attend(q, k, v).transpose(1, 2).reshape(b, s, w))
        return self.head(x)


def test_every_form_of_causal_or_unmasked_attention_is_planned_as_a_ring():
    """The cp walk (the plan's and the rewrite's) runs each form as ring attention, the
    positional (q, k, v, None, 0.0, True) included, and gathers the sequence for a mask
    or dropout, which the ring does not take."""
    for form in ATTENTION_FORMS:
        captured = capture(ViewsAttentionLM(form), (token_batch(2, SEQ)[0],))
        analyze(captured.gm, captured.context())
        gm = captured.gm
        seeds = {node.name: Shard(1) for node in sequence_inputs(gm)}
        result = propagate(
            gm, captured.parameter_names, {}, 2, input_places=seeds, context_parallel=True
        )
        attention = [n for n in gm.graph.nodes if op_name(n) == "scaled_dot_product_attention"]
        assert len(attention) == 2
        for node in attention:
            decision = result.decisions[node]
            assert decision.local_op == "ring_attention", (form, node.args, decision.fallback)
            assert result.places[node] == Shard(2)


class _Refused(nn.Module):
    """Attention that ring attention does not take: with dropout, or a mask input."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.embed = nn.Embedding(VOCAB, 16)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        b, s, _ = x.shape
        q = k = v = x.view(b, s, 2, 8).transpose(1, 2)
        if self.kind == "dropout":
            return F.scaled_dot_product_attention(q, k, v, None, 0.1, True)
        return F.scaled_dot_product_attention(q, k, v, mask)


@pytest.mark.parametrize("kind", ["dropout", "mask"])
def test_attention_the_ring_does_not_take_gathers_the_sequence(kind):
    ids = token_batch(2, SEQ)[0]
    mask = torch.rand(SEQ, SEQ) > 0.5
    captured = capture(_Refused(kind), (ids, mask))
    analyze(captured.gm, captured.context())
    gm = captured.gm
    seeds = {node.name: Shard(1) for node in sequence_inputs(gm)}
    result = propagate(
        gm, captured.parameter_names, {}, 2, input_places=seeds, context_parallel=True
    )
    (node,) = [n for n in gm.graph.nodes if op_name(n) == "scaled_dot_product_attention"]
    decision = result.decisions[node]
    assert decision.local_op == "" and decision.fallback, decision


def _train_forms(batch) -> dict:
    return {
        form: train_case(ViewsAttentionLM(form), batch, STEPS, inspect=_graph_of, cp=2)
        for form in ATTENTION_FORMS
    }


@pytest.mark.slow  # cp=2 is checked quick; attention over views in the slow sweeps
def test_ring_attention_over_views_trains_like_one_device():
    """cp=2 on 2 Gloo ranks over keys and values that are transposed views, for each
    form of the call: every rank's losses and parameters are one device's, each layer's
    attention runs as a ring, and the only gather of the sequence is the logits'."""
    batch = token_batch(4, SEQ)
    per_rank = run_world(_train_forms, 2, batch)
    for form in ATTENTION_FORMS:
        reference = train_reference(ViewsAttentionLM(form), "adamw", STEPS, (batch[0],), batch[1])
        assert_every_rank_matches(per_rank, form, reference)
        assert [r[form]["rings"] for r in per_rank] == [2, 2], form
        assert [r[form]["kinds"][("cp", "all_gather")] for r in per_rank] == [1, 1], form


# -- attention over a fused projection, laid out as the captured kernel's -------------


class FusedProjectionLM(nn.Module):
    """A GPT-2-style causal language model written as nanoGPT writes it: learned
    positions, q, k and v split out of one fused projection, and the attention's output
    made `.transpose(1, 2).contiguous().view(b, s, w)`. The fused kernel returned that
    output laid out as [batch, seq, heads, head_dim] at capture, so torch.export dropped
    the `.contiguous()` as a no-op: ring attention must return the same layout for the
    view to hold."""

    def __init__(self, width: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.heads = heads
        self.embed, self.positions = nn.Embedding(VOCAB, width), nn.Embedding(SEQ, width)
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(layers))
        self.c_attn = nn.ModuleList(nn.Linear(width, 3 * width) for _ in range(layers))
        self.c_proj = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.head = nn.Linear(width, VOCAB)
        with torch.no_grad():  # a key bias off zero (`tests.models.key_biases_off_zero`)
            for c_attn in self.c_attn:
                c_attn.bias.normal_(0.0, 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        x = self.embed(ids) + self.positions(torch.arange(s, device=ids.device))
        for norm, c_attn, c_proj in zip(self.norms, self.c_attn, self.c_proj):
            w = x.shape[-1]
            q, k, v = c_attn(norm(x)).split(w, dim=2)
            q, k, v = (t.view(b, s, self.heads, w // self.heads).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + c_proj(y.transpose(1, 2).contiguous().view(b, s, w))
        return self.head(x)


# On 4 ranks, besides cp=2 × tp=2, tp=2 with sequence parallelism: each rank adds the
# row-parallel projection's bias to its own tokens, so the bias's gradient is summed
# over tp.
FUSED_CASES = {
    2: [{"cp": 2}],
    4: [{"cp": 2, "tp": 2}, {"dp": 2, "tp": 2, "sequence_parallel": True}],
}


def _train_fused(batch, cases) -> dict:
    return {
        case_key("fused", pins): train_case(
            FusedProjectionLM(), batch, STEPS, inspect=_graph_of, **pins
        )
        for pins in cases
    }


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ring_attention_over_a_fused_projection_keeps_the_captured_layout(world):
    """cp=2 on 2 Gloo ranks, and cp=2 × tp=2 on 4, of the nanoGPT-style model (2 layers,
    8 sequences of 64 tokens): the captured view after attention holds on ring
    attention's output, each layer's attention runs as a ring, and every rank's losses
    and parameters are one device's (on 4, under sequence parallelism too)."""
    batch = token_batch(8, SEQ)
    reference = train_reference(FusedProjectionLM(), "adamw", STEPS, (batch[0],), batch[1])
    per_rank = run_world(_train_fused, world, batch, FUSED_CASES[world])
    for pins in FUSED_CASES[world]:
        key = case_key("fused", pins)
        assert_every_rank_matches(per_rank, key, reference, label=pins)
        assert all(r[key]["rings"] == (2 if "cp" in pins else 0) for r in per_rank), pins


# -- positions read from a table, under cp × tp with sequence parallelism -------------

SP_PINS = {"cp": 2, "dp": 1, "tp": 2, "sequence_parallel": True}


def _train_position_tables(batch) -> dict:
    return {
        name: train_case(model(), batch, STEPS, **SP_PINS)
        for name, model in (("fused", FusedProjectionLM), ("gpt2", tiny_gpt2))
    }


@pytest.mark.slow
def test_learned_positions_under_cp_and_sequence_parallelism_match_one_device():
    """cp=2 × tp=2 with sequence parallelism on 4 Gloo ranks, of the nanoGPT-style model
    and GPT-2 (positions read from a table at whole positions): the table's lookup is
    cut into cp's mirrored chunks first and tp's slice of them second, as the tokens
    are, so every rank's losses and parameters are one device's."""
    batch = token_batch(8, SEQ)
    per_rank = run_world(_train_position_tables, 4, batch)
    for name, model in (("fused", FusedProjectionLM), ("gpt2", tiny_gpt2)):
        reference = train_reference(model(), "adamw", STEPS, (batch[0],), batch[1])
        assert_every_rank_matches(per_rank, name, reference, label=name)
