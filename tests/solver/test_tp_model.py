"""The per-operator tensor-parallel model: its optimum equals a brute force over every
parameter placement under the same costs, and the experts' layouts come out of the
costs (column/row pairs, vocabulary parallelism where the vocabulary is large, the MLP
of a parallel block with multi-query attention)."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from autopart.capture import capture
from autopart.cost_models import CostModels
from autopart.cost_models.tp_costs import TpCosts
from autopart.mesh import Mesh
from autopart.ops.loss_match import match_cross_entropy
from autopart.passes import analyze
from autopart.passes.tp_propagate import propagate
from autopart.solver.tp_model import build_problem, layout_cost, solve_layout
from tests.models import LM_FACTORIES, lm_loss, token_batch

R = Replicate()


class MlpLM(nn.Module):
    """Two residual MLP blocks between an embedding and a head."""

    def __init__(self, vocab: int = 64, hidden: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(hidden, elementwise_affine=False),
                nn.Linear(hidden, 4 * hidden),
                nn.GELU(),
                nn.Linear(4 * hidden, hidden),
            )
            for _ in range(2)
        )
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, hidden // heads
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, kv_heads * self.dim, bias=False)
        self.v = nn.Linear(hidden, kv_heads * self.dim, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q = self.q(x).view(b, s, self.heads, self.dim).transpose(1, 2)
        k = self.k(x).view(b, s, self.kv_heads, self.dim).transpose(1, 2)
        v = self.v(x).view(b, s, self.kv_heads, self.dim).transpose(1, 2)
        if self.kv_heads != self.heads:
            k = k.expand(b, self.heads, s, self.dim)  # multi-query: one K/V for all heads
            v = v.expand(b, self.heads, s, self.dim)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, h))


class AttentionLM(nn.Module):
    def __init__(self, vocab: int = 64, hidden: int = 32, heads: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, hidden)
        self.attn = Attention(hidden, heads, heads)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        x = x + self.attn(F.layer_norm(x, x.shape[-1:]))
        return self.head(x)


class ParallelBlock(nn.Module):
    """Attention and MLP side by side on one normed input (GPT-J, PaLM), with
    multi-query attention."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads, kv_heads=1)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return x + self.attn(y) + self.down(F.gelu(self.up(y)))


class ParallelBlockLM(nn.Module):
    def __init__(self, vocab: int = 512, hidden: int = 512, heads: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(ParallelBlock(hidden, heads) for _ in range(2))
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _problem(
    model: nn.Module, batch: int, seq: int, mesh: Mesh, tp: int, meta: bool = False, sp=False
):
    device = "meta" if meta else "cpu"
    if meta:
        model = model.to("meta")
    ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
    captured = capture(model, (ids,))
    analyze(captured.gm, captured.context())
    gm, names = captured.gm, captured.parameter_names
    costs = TpCosts(gm, CostModels.of(mesh, "fp32"), {**captured.dim_sizes, "batch": 1}, tp)
    return gm, names, costs, build_problem(gm, names, tp, costs, sp)


MESHES = {"h100": Mesh.cluster("h100-80g", 1, 8), "cpu": Mesh.cluster("cpu", 1, 8)}


@pytest.mark.parametrize(
    "factory, tp, mesh, sp",
    [
        (MlpLM, 2, "h100", False),
        (MlpLM, 4, "h100", False),
        (MlpLM, 2, "cpu", False),
        (MlpLM, 4, "cpu", False),
        (AttentionLM, 2, "h100", False),
        pytest.param(AttentionLM, 4, "cpu", False, marks=pytest.mark.slow),
        (MlpLM, 2, "h100", True),
        pytest.param(AttentionLM, 2, "h100", True, marks=pytest.mark.slow),
    ],
)
def test_the_model_finds_the_brute_force_optimum(factory, tp, mesh, sp):
    gm, names, costs, problem = _problem(factory(), 4, 16, MESHES[mesh], tp, sp=sp)
    variables = sorted(set(problem.param_var.values()))

    def cost(placements):
        return layout_cost(problem, gm, names, placements, costs, sp)

    best = min(
        cost(_expand(problem, dict(zip(variables, choice))))
        for choice in itertools.product(*(problem.candidates[v] for v in variables))
    )
    solution = solve_layout(problem)
    assert solution.status == "OPTIMAL"
    assert solution.cost == pytest.approx(best, rel=1e-4)
    # The objective is what the rewrite's own walk of the chosen layout costs.
    assert cost(solution.placements) == pytest.approx(solution.cost, rel=1e-9)


def _expand(problem, chosen):
    return {fqn: place for fqn, var in problem.param_var.items() if (place := chosen[var]) != R}


def _llama(vocab: int, hidden: int = 1024, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=2048,
        use_cache=False,
    )
    with torch.device("meta"):
        return LlamaForCausalLM(config)


@functools.cache
def _llama_problem(vocab: int):
    """`_problem` of `_llama(vocab)` for one sequence of 2048 tokens at tp=2 on H100s,
    made once for the tests below, which read it and change nothing of it."""
    return _problem(_llama(vocab), 1, 2048, MESHES["h100"], 2, meta=True)


def test_column_and_row_parallel_layers_emerge_from_the_costs():
    gm, names, costs, problem = _llama_problem(32000)
    places = solve_layout(problem).placements
    for i in range(2):
        layer = f"model.layers.{i}"
        for column in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            assert places[f"{layer}.{column}.weight"] == Shard(0)
        for column in ("mlp.gate_proj", "mlp.up_proj"):
            assert places[f"{layer}.{column}.weight"] == Shard(0)
        assert places[f"{layer}.self_attn.o_proj.weight"] == Shard(1)
        assert places[f"{layer}.mlp.down_proj.weight"] == Shard(1)
        assert f"{layer}.input_layernorm.weight" not in places
    assert propagate(gm, names, places, 2).fallbacks == []


def test_vocabulary_parallelism_is_chosen_when_the_vocabulary_dominates():
    _, _, _, problem = _llama_problem(32000)
    large = solve_layout(problem).placements
    assert large["model.embed_tokens.weight"] == Shard(0)  # masked lookup + all-reduce
    assert large["lm_head.weight"] == Shard(0)  # column-parallel over the vocabulary
    _, _, _, problem = _llama_problem(128)
    small = solve_layout(problem).placements  # 128 tokens: sharding the vocabulary
    assert small.get("model.embed_tokens.weight") != Shard(0)  # saves less than it costs
    assert small.get("lm_head.weight") != Shard(0)


def test_the_logits_of_a_parallel_cross_entropy_are_priced_without_their_gather():
    """With a standard cross-entropy recognized, the runtime computes it from logits
    sharded over the vocabulary: the layout's walk leaves them sharded, the model prices
    no gather for them, and the plan predicts less tensor-parallel communication."""
    import autopart

    gm, names, costs, problem = _llama_problem(32000)
    leaf = match_cross_entropy(lm_loss, gm).logits
    gathered = solve_layout(problem)
    parallel = solve_layout(build_problem(gm, names, 2, costs, sharded_logits=leaf))
    assert parallel.placements["lm_head.weight"] == Shard(0)
    (output,) = gm.graph.find_nodes(op="output")
    walks = [propagate(gm, names, parallel.placements, 2, sharded_logits=s) for s in (None, leaf)]
    assert leaf in walks[0].decisions[output].inputs  # gathered whole for the user's loss
    assert leaf not in walks[1].decisions[output].inputs
    assert parallel.cost < gathered.cost

    ids = torch.zeros(8, 2048, dtype=torch.long, device="meta")
    plans = [
        autopart.plan(_llama(32000), MESHES["h100"], (ids,), dp=4, tp=2, pp=1, loss_fn=loss)
        for loss in (None, lm_loss)
    ]
    comm = [p.predicted.stages[-1].tp_comm_s for p in plans]
    assert comm[1] < comm[0]


@pytest.mark.slow  # tp plans of a larger model; the brute-force checks run quick
def test_sequence_parallelism_comes_out_of_the_costs():
    """Sequence parallelism is a choice the costs make: on H100s at a long sequence its
    Megatron layout (row-parallel products reduce-scattered, the norms on sequence
    shards) costs less than all-reducing, so it is chosen; on a CPU mesh, where each
    collective's latency dominates a tiny model's, it is not."""
    from autopart.solver.tp_layouts import TpLayouts

    ids = torch.zeros(1, 4096, dtype=torch.long, device="meta")
    captured = capture(_llama(32000, hidden=4096), (ids,))
    analyze(captured.gm, captured.context())
    layouts = TpLayouts(captured.gm, captured.parameter_names, MESHES["h100"], {"seq": 4096})
    assert layouts.sequence_parallel(8)
    places = layouts.placements(8, True)
    assert places["model.layers.1.mlp.down_proj.weight"] == Shard(1)
    assert places["model.layers.1.self_attn.o_proj.weight"] == Shard(1)

    captured = capture(LM_FACTORIES["llama"](), (token_batch(8)[0],))
    analyze(captured.gm, captured.context())
    dims = {k: v for k, v in captured.dim_sizes.items() if k != "batch"}
    layouts = TpLayouts(captured.gm, captured.parameter_names, MESHES["cpu"], dims)
    assert not layouts.sequence_parallel(2)


def test_a_parallel_block_with_multi_query_attention_gets_its_mlp_sharded():
    # The Megatron pattern finds no layout here: q, k, v and up read one activation, and
    # the single K/V head cannot be split.
    model = ParallelBlockLM()
    _, _, _, problem = _problem(model, 1, 1024, MESHES["h100"], 2, meta=True)
    places = solve_layout(problem).placements
    for i in range(2):
        assert places[f"layers.{i}.up.weight"] == Shard(0)
        assert places[f"layers.{i}.down.weight"] == Shard(1)
        assert places[f"layers.{i}.attn.q.weight"] == Shard(0)  # query heads split,
        assert places[f"layers.{i}.attn.o.weight"] == Shard(1)  # the one K/V head sliced


def test_explain_names_what_each_sharded_parameter_does():
    import autopart

    ids = torch.zeros(8, 2048, dtype=torch.long, device="meta")
    plan = autopart.plan(
        _llama(32000), MESHES["h100"], (ids,), dp=4, tp=2, pp=1, sequence_parallel=False
    )
    roles = plan.tp_roles
    assert roles["model.embed_tokens.weight"] == "vocabulary-parallel"
    assert roles["lm_head.weight"] == "column-parallel"
    assert roles["model.layers.1.self_attn.q_proj.weight"] == "column-parallel"
    assert roles["model.layers.0.mlp.down_proj.weight"] == "row-parallel"
    text = plan.explain()
    assert "row-parallel: model.layers.*.self_attn.o_proj.weight (×2)" in text
    assert "vocabulary-parallel: model.embed_tokens.weight" in text
    # Where it reshards: each row-parallel product's all-reduce, once per layer and
    # microbatch, and all of them together cost what the step's prediction charges.
    assert "all-reduce (forward) for linear at model.layers.*.self_attn.o_proj: 2 × " in text
    sites = plan.predicted.resharding
    (stage,) = plan.predicted.stages
    assert sum(r.seconds for r in sites) == pytest.approx(stage.tp_comm_s, rel=1e-9)
    again = autopart.Plan.from_json(plan.to_json())
    assert again.tp_roles == roles and again.predicted.resharding == sites
