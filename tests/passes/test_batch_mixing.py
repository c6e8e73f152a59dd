"""Operators that mix the examples of a batch are found (BatchNorm in training mode, a
batch × batch product, routing that ranks or counts the batch's tokens); the ones that
keep them apart are not. Found by the model zoo: a BatchNorm CNN trained under dp=2
drifted from one device (each rank normalized by its half's statistics), and CLIP's
image × caption scores under dp=2 crashed in its loss; and by the equivalence sweep:
expert-choice routing at dp=2 trained to 2.8686 where one device gave 2.8648, and a
capacity-limited layer likewise, unrefused. The plans of such models keep the batch
whole (tests/solver/test_search.py, and below), but for batch norms as torch.export
captures them, which the batch-norm rewrite reduces over the replicas
(passes/batch_norm.py): only microbatches keep them whole."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopart
from autopart.capture import capture
from autopart.ops.aten import op_name
from autopart.passes import analyze
from autopart.passes.batch_mixing import (
    batch_mixing,
    gathered_products,
    mixing_over_replicas,
    product_operands,
    replica_statistics,
)
from autopart.passes.product_rows import row_operands
from tests.models import MLP, RouterLoss, tiny_mixtral, token_batch
from tests.random_models import Case, RandomLM, batch_of


def _mixing(model: nn.Module, *inputs: torch.Tensor) -> list[str]:
    captured = capture(model, inputs)
    analyze(captured.gm, captured.context())
    return batch_mixing(captured.gm)


class ConvNorm(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x)).mean(dim=(2, 3))


class PairScores(nn.Module):
    """Every example's embedding against every other's, as CLIP scores images and
    captions, and a per-example score beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = F.normalize(self.a(x), dim=-1), F.normalize(self.b(x), dim=-1)
        return (a * b).sum(-1), (a @ b.T) * 10.0


IMAGES = torch.randn(4, 3, 8, 8)


def test_batch_norm_in_training_mode_mixes_the_batch_and_is_named_by_module():
    (found,) = _mixing(ConvNorm(nn.BatchNorm2d(4)), IMAGES)
    assert found == "batch_norm in training mode normalizes over the batch, at norm"


def test_batch_norms_the_rewrite_reduces_over_replicas_are_told_apart():
    """A training-mode batch norm as torch.export captures it is exact over replicas
    once rewritten (passes/batch_norm.py), but not over microbatches; per-part
    statistics take it over each part."""
    captured = capture(ConvNorm(nn.BatchNorm2d(4)), (IMAGES,))
    analyze(captured.gm, captured.context())
    assert batch_mixing(captured.gm, over_replicas=False) == []
    assert batch_mixing(captured.gm, statistics=False) == []
    (norm,) = mixing_over_replicas(captured.gm)
    assert norm == "batch_norm in training mode normalizes over the batch, at norm"


@pytest.mark.parametrize(
    "norm",
    [nn.BatchNorm2d(4).eval(), nn.GroupNorm(2, 4), nn.InstanceNorm2d(4, affine=True)],
    ids=["batch_norm_eval", "group_norm", "instance_norm"],
)
def test_norms_over_each_example_keep_the_batch_apart(norm):
    # Instance norm runs as a batch norm of one example with batch × channels channels.
    assert _mixing(ConvNorm(norm), IMAGES) == []


def test_a_batch_by_batch_product_is_found_where_it_arises_only():
    (found,) = _mixing(PairScores(), torch.randn(4, 8))
    assert found.startswith("matmul gives a batch × batch result")


def test_a_model_that_keeps_the_examples_apart_mixes_nothing():
    assert _mixing(MLP(), torch.randn(4, 32)) == []


def _routed(
    routing: str, kernel: str = "fallback", top_k: int = 2
) -> tuple[nn.Module, torch.Tensor]:
    """The equivalence sweep's mixture-of-experts block (tests/random_models.py) routing
    as asked: "token" (dropless: sorted by expert and back), "capacity" (each expert
    keeps its first rows in token order), "expert" (each expert takes its top tokens)."""
    case = Case(
        width=8, vocab=32, blocks=("moe",), tied=False, pins=(), seed=0,
        routing=routing, kernel=kernel, top_k=top_k,
    )  # fmt: skip
    return RandomLM(case), batch_of(case)[0]


class SwitchCapacity(nn.Module):
    """Switch Transformer's top-1 routing with a capacity: a token's place in its
    expert's queue is a running count of the tokens before it (cumsum over the rows),
    and the tokens past the capacity are dropped."""

    def __init__(self, experts: int = 4, width: int = 8) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts)
        self.experts = nn.Parameter(torch.randn(experts, width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.router(tokens), dim=-1)
        weight, expert = probs.max(dim=-1)
        one_hot = F.one_hot(expert, self.experts.shape[0])
        place = (one_hot.cumsum(dim=0) * one_hot).sum(dim=-1)  # 1-based, in token order
        kept = place <= tokens.shape[0] // self.experts.shape[0]
        out = torch.einsum("tw,twv->tv", tokens, self.experts[expert])
        return (out * (weight * kept).unsqueeze(-1)).reshape(x.shape)


class ExpertChoiceBySort(nn.Module):
    """Expert choice written with a sort: each expert keeps the first rows of its scores
    over the tokens, sorted."""

    def __init__(self, experts: int = 4, width: int = 8) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        scores = F.softmax(self.router(tokens), dim=-1).t()
        ranked = torch.sort(scores, dim=-1, descending=True, stable=True)
        keep = tokens.shape[0] // scores.shape[0]
        chosen, weight = ranked.indices[:, :keep], ranked.values[:, :keep]
        out = torch.zeros_like(tokens).index_add(0, chosen.reshape(-1), tokens[chosen.reshape(-1)])
        return (out * weight.sum()).reshape(x.shape)


@pytest.mark.parametrize("kernel", ["fallback", "grouped_mm"])
def test_routing_that_ranks_or_counts_the_batch_s_tokens_mixes_it(kernel):
    (capacity,) = _mixing(*_routed("capacity", kernel))
    assert capacity.startswith("lt compares a row's position among the batch's rows")
    (chosen,) = _mixing(*_routed("expert", kernel))
    assert chosen.startswith("topk ranks the batch's rows")
    (switch,) = _mixing(SwitchCapacity(), torch.randn(2, 6, 8))
    assert "position among the batch's rows" in switch
    (by_sort,) = _mixing(ExpertChoiceBySort(), torch.randn(2, 6, 8))
    assert by_sort.startswith("slice keeps the first rows of a sort over the batch's rows")


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("kernel", ["fallback", "grouped_mm"])
def test_dropless_routing_moves_rows_by_their_positions_and_mixes_nothing(kernel, top_k):
    """Sorting the rows by expert and back (the sort's indices, an arange scattered into
    the inverse permutation, offsets from a histogram) keeps each token's result its own."""
    assert _mixing(*_routed("token", kernel, top_k)) == []


def test_mixtral_routing_mixes_nothing():
    """Hugging Face's Mixtral layers keep each token's result its own too."""
    assert _mixing(tiny_mixtral(), token_batch(8)[0]) == []


def test_routing_over_the_batch_keeps_it_whole_unless_asked():
    """Expert-choice and capacity-limited routing rank or count the whole batch's
    tokens, which no rewrite takes over the replicas: a split of the batch over dp or
    ep is refused, saying where, unless the user takes the routing per part, which the
    plan then states."""
    mesh = autopart.Mesh.cluster("cpu", nodes=1, per_node=2)
    model, ids = _routed("expert")
    assert autopart.plan(model, mesh, (ids,)).dp == 1
    capacity, _ = _routed("capacity")
    for routed, why in ((model, "topk ranks the batch's rows"), (capacity, "an expert's capacity")):
        for pins in ({"dp": 2}, {"ep": 2}):
            with pytest.raises(autopart.PlanError, match=f"would split the batch.*{why}"):
                autopart.plan(routed, mesh, (ids,), **pins)
    accepted = autopart.plan(model, mesh, (ids,), dp=2, per_part_statistics=True)
    assert (
        accepted.dp == 2
        and "routing over the batch's tokens (an expert's capacity, expert choice)"
        in accepted.explain()
    )


class BiasedScores(PairScores):
    """CLIP's scores plus a per-example bias: the whole product meets this replica's
    examples alone, which gathering the product's operands cannot make whole."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)[1] + self.a(x)[:, :1]


def _analyzed(model: nn.Module, *inputs: torch.Tensor):
    captured = capture(model, inputs)
    analyze(captured.gm, captured.context())
    return captured.gm


def test_a_batch_by_batch_product_is_gathered_over_replicas_where_nothing_else_meets_it():
    """Its operands are gathered (passes/batch_products.py): exact over replicas, not
    over microbatches. A product that meets another value of the batch stays mixing."""
    gm = _analyzed(PairScores(), torch.randn(4, 8))
    (product,) = gathered_products(gm)
    assert [dim for _, dim in product_operands(product)] == [0, 1]
    assert batch_mixing(gm, over_replicas=False) == []
    (line,) = mixing_over_replicas(gm)
    assert line.startswith("matmul gives a batch × batch result")
    biased = _analyzed(BiasedScores(), torch.randn(4, 8))
    assert gathered_products(biased) == []
    assert batch_mixing(biased, over_replicas=False) != []


class MaxLoad(nn.Module):
    """A load penalty from the busiest expert's share: a maximum over the batch, which
    no mean over replicas gives."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(self.router(x), dim=-1)
        return probs, probs.amax(dim=0).exp().sum() * probs.mean(dim=0).sum()


def test_a_load_balancing_loss_is_taken_over_replicas_from_its_means_and_divided_sums():
    """Every replica takes the mean of the replicas' divided sums
    (passes/batch_statistics.py). A maximum over the batch is not a mean of anything,
    and stays mixing."""
    gm = _analyzed(RouterLoss(), torch.randn(2, 6, 8))
    found = replica_statistics(gm)
    assert found is not None
    assert sorted(op_name(r) for r in found.roots) == ["histc", "sum"]
    assert batch_mixing(gm, over_replicas=False) == []
    assert replica_statistics(_analyzed(MaxLoad(), torch.randn(6, 8))) is None


class TransposedScores(PairScores):
    """Hugging Face CLIP's way: the captions' scores against the images, returned
    transposed as each image's against the captions."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = F.normalize(self.a(x), dim=-1), F.normalize(self.b(x), dim=-1)
        return (b @ a.T).T * 10.0


class BothWays(PairScores):
    """The scores and their transpose both returned: no one side gives every output's
    rows."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = super().forward(x)[1]
        return scores, scores.T


def test_the_side_that_gives_a_product_s_rows_is_the_one_each_replica_keeps():
    """Under a loss over the rows, a replica keeps that side's embeddings its own and
    gathers the other (passes/batch_products.py): the side whose batch leads every
    output computed from the product, transposed or not."""
    for model, side in ((PairScores(), 0), (TransposedScores(), 1)):
        gm = _analyzed(model, torch.randn(4, 8))
        (product,) = gathered_products(gm)
        assert row_operands(gm) == {product: product_operands(product)[side][0]}
    assert row_operands(_analyzed(BothWays(), torch.randn(4, 8))) is None
