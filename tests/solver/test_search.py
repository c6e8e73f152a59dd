"""The solver's choices in known cases: ample memory keeps data parallelism; a model
that cannot fit so is sharded until it fits; pins that cannot fit are refused with by
how much and what would fit; the same question gets the same answer."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.optim import Adafactor, AdamW

import autopart
from autopart.capture import capture
from autopart.cost_models import Choices, predict
from autopart.degrees import Degrees
from autopart.mesh import Mesh
from autopart.passes import analyze
from autopart.plan import Predicted
from autopart.solver import Pins, make_plan
from autopart.solver.search import SLACK, Candidate, _admissible, _solve
from tests.harness import slow_links_cpu
from tests.models import LM_FACTORIES, lm_loss, tiny_gpt2, token_batch

GiB = 1024**3


def _gpt2_small():
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):  # GPT-2 small's width, four of its layers
        return GPT2LMHeadModel(GPT2Config(n_layer=4, use_cache=False))


def _llama_8b_dims(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=4096,
        use_cache=False,
    )
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def _tokens(batch: int, seq: int) -> torch.Tensor:
    return torch.zeros(batch, seq, dtype=torch.long, device="meta")


@pytest.fixture(scope="module")
def gpt2_small():
    """GPT-2 small's width at 64 sequences of 1024 tokens, captured and analyzed once:
    planning reads the capture without changing it."""
    captured = capture(_gpt2_small(), (_tokens(64, 1024),))
    analyze(captured.gm, captured.context())
    return captured


def test_ample_memory_keeps_data_parallelism(gpt2_small):
    mesh = Mesh.cluster("h100-80g", nodes=1, per_node=8)
    captured = gpt2_small
    plan = make_plan(captured, mesh, Pins(precision="bf16-mixed"))
    assert (plan.dp, plan.tp, plan.pp) == (8, 1, 1)
    assert not plan.recompute
    assert plan.predicted.peak_memory_bytes < 80 * GiB
    assert plan.alternatives and all(
        a.step_time_s >= plan.predicted.step_time_s * 0.95 for a in plan.alternatives
    )
    assert make_plan(captured, mesh, Pins(precision="bf16-mixed")) == plan  # deterministic


def test_a_model_too_large_for_data_parallelism_is_sharded_until_it_fits():
    mesh = Mesh.cluster("a100-80g", nodes=1, per_node=8)
    model, ids = _llama_8b_dims(16), _tokens(8, 2048)
    with pytest.raises(autopart.PlanError) as refused:
        autopart.plan(model, mesh, ids, dp=8, zero=0, recompute=())
    message = str(refused.value)
    assert "no plan fits the device's 80.00 GiB" in message and "too much" in message
    assert "What fits:" in message
    plan = autopart.plan(model, mesh, ids)
    assert plan.zero >= 1 or plan.tp > 1 or plan.pp > 1
    assert plan.predicted.peak_memory_bytes <= 80 * GiB


@pytest.mark.slow  # every plan of a model priced
def test_the_floors_prune_no_plan_the_search_would_choose(monkeypatch):
    """The search prices plans in the order of their step floors and stops at the first
    floor beyond the slack of the fastest fitting plan found: with every floor at 0 (no
    plan left unpriced), it chooses the same plan, at the same prediction. A model that
    fits only sharded, recomputed or pipelined, so that the inner model fits plans."""
    import autopart.solver.search as search

    mesh = Mesh.cluster("a100-80g", nodes=1, per_node=8)
    captured = capture(_llama_8b_dims(16), (_tokens(8, 2048),))
    analyze(captured.gm, captured.context())
    pins = Pins(precision="bf16-mixed")
    pruned = make_plan(captured, mesh, pins)
    monkeypatch.setattr(search, "step_time_lower_bound", lambda *args, **kwargs: 0.0)
    monkeypatch.setattr(search, "_fitted_floor", lambda *args: 0.0)
    everything = make_plan(captured, mesh, pins)
    assert pruned.recompute or pruned.zero or pruned.pp > 1
    assert replace(pruned, alternatives=()) == replace(everything, alternatives=())

    def within_slack(plan):  # the plans either search must price
        fastest = min(a.step_time_s for a in (plan.predicted, *plan.alternatives))
        return [a for a in plan.alternatives if a.step_time_s <= (1 + SLACK) * fastest]

    assert within_slack(pruned) == within_slack(everything)


@pytest.mark.slow  # a larger model planned twice
def test_zero3_is_left_out_for_an_optimizer_that_reads_whole_tensors(gpt2_small):
    """ZeRO-3 shards parameters flat: exact for AdamW, not for Adafactor's row and column
    statistics. ZeRO-1/2 step whole parameters for Adafactor (runtime/zero_owners.py),
    so the solver keeps them and leaves ZeRO-3 out, and a pin or a plan that asks for
    ZeRO-3 is refused before anything runs."""
    mesh = Mesh.cluster("h100-80g", nodes=1, per_node=8)
    captured = gpt2_small
    adamw = make_plan(captured, mesh, Pins.of(precision="bf16-mixed", optimizer_class=AdamW))
    assert any(c.zero == 3 for c in (adamw, *adamw.alternatives))
    pins = Pins.of(precision="bf16-mixed", optimizer_class=Adafactor)
    adafactor = make_plan(captured, mesh, pins)
    zeros = {c.zero for c in (adafactor, *adafactor.alternatives)}
    assert 3 not in zeros and zeros & {1, 2}
    with pytest.raises(autopart.PlanError, match="Adafactor is not known to be one"):
        make_plan(captured, mesh, Pins.of(zero=3, optimizer_class=Adafactor))

    model, ids = tiny_gpt2(), token_batch(8)[0]
    cpu = Mesh.cluster("cpu", nodes=1, per_node=2)
    plan = autopart.plan(model, cpu, (ids,), dp=2, zero=3)
    for how in ({"plan": plan}, {"dp": 2, "zero": 3}):
        with pytest.raises(autopart.PlanError, match="ZeRO-3 shards every parameter flat"):
            autopart.parallelize(model, cpu, (ids,), optimizer=Adafactor, **how)


def _memory_between(captured, mesh, tight: Choices, loose: Choices) -> Mesh:
    """A mesh like `mesh` whose devices fit `loose` but not `tight`."""
    need = [predict(captured.gm, mesh, c).peak_memory_bytes for c in (tight, loose)]
    assert need[1] < need[0]
    device = replace(mesh.device, memory_bytes=(need[0] + need[1]) // 2)
    return Mesh.cluster(device, nodes=mesh.nodes, per_node=mesh.per_node)


def test_gradient_accumulation_keeps_plain_data_parallelism_in_memory(gpt2_small):
    """Without a pipeline, microbatches accumulate gradients: when a replica's whole
    batch does not fit, smaller microbatches do, without pp, ZeRO or recomputation."""
    mesh = Mesh.cluster("h100-80g", nodes=1, per_node=8)
    captured = gpt2_small
    whole, accumulated = (
        Choices(64, Degrees(dp=8), microbatches=m, precision="bf16-mixed") for m in (1, 8)
    )
    tight = _memory_between(captured, mesh, whole, accumulated)
    pins = Pins.of(dp=8, tp=1, pp=1, zero=0, recompute=(), precision="bf16-mixed")
    plan = make_plan(captured, tight, pins)
    assert plan.microbatches > 1 and plan.predicted.peak_memory_bytes <= tight.device.memory_bytes


def test_attention_cores_alone_are_recomputed_where_that_suffices():
    """Selective recomputation: where recomputing every block's attention core fits the
    device, the solver chooses it over recomputing whole blocks (which adds more time),
    and the explanation says what it frees."""
    mesh = Mesh.cluster("h100-80g", nodes=1, per_node=4)
    captured = capture(LM_FACTORIES["gpt2-eager"](layers=4), (token_batch(8, seq=64)[0],))
    analyze(captured.gm, captured.context())
    blocks = tuple(f"transformer.h.{i}" for i in range(4))
    plain, selective = (
        Choices(8, Degrees(dp=4), recompute_attention=cores) for cores in ((), blocks)
    )
    tight = _memory_between(captured, mesh, plain, selective)
    plan = make_plan(captured, tight, Pins.of(dp=4, zero=0, microbatches=1))
    assert plan.recompute_attention and not plan.recompute
    assert plan.predicted.peak_memory_bytes <= tight.device.memory_bytes
    assert "the attention core alone" in plan.explain()


@pytest.mark.slow  # test_stages.py's quick cases plan pipelines
def test_a_deep_pipeline_gets_many_small_microbatches():
    """Microbatch sizes of 1, 2, 4 ... samples, not only pp, 2pp and 4pp microbatches:
    a pipeline that fits only with microbatches of one or two samples gets them."""
    mesh = Mesh.cluster("a100-80g", nodes=1, per_node=4)
    captured = capture(_llama_8b_dims(8), (_tokens(64, 2048),))
    analyze(captured.gm, captured.context())
    common = dict(degrees=Degrees(pp=4), schedule="1f1b", precision="bf16-mixed")
    usual, small = (Choices(64, microbatches=m, **common) for m in (16, 64))
    tight = _memory_between(captured, mesh, usual, small)
    pins = Pins.of(dp=1, tp=1, pp=4, zero=0, recompute=(), schedule="1f1b", precision="bf16-mixed")
    plan = make_plan(captured, tight, pins)
    assert plan.microbatches in (32, 64)


def test_a_long_solve_reports_its_progress(monkeypatch, caplog):
    """Progress is logged every PROGRESS_EVERY_S seconds; at 0, after every plan."""
    import logging

    import autopart
    from autopart.solver import search
    from tests.models import tiny_gpt2, token_batch

    monkeypatch.setattr(search, "PROGRESS_EVERY_S", 0.0)
    with caplog.at_level(logging.INFO, logger="autopart.solver"):
        autopart.plan(tiny_gpt2(), autopart.Mesh.cluster("cpu", 1, 4), (token_batch(8)[0],))
    lines = [r.getMessage() for r in caplog.records if "solver: pricing plans:" in r.getMessage()]
    assert lines and lines[-1].startswith("solver: pricing plans: ") and " of " in lines[-1]


class BatchNormNet(nn.Module):
    """Conv, BatchNorm (training mode: statistics over the batch), then a small MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1),
            nn.BatchNorm2d(4),
            nn.Flatten(),
            nn.Linear(64, 8),
            nn.ReLU(),
            nn.Linear(8, 2),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class Similarities(nn.Module):
    """Every example's embedding scored against every other's (a batch × batch product,
    as CLIP's image × caption scores), after a small MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Flatten(), nn.Linear(48, 8), nn.ReLU(), nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        embedded = self.layers(x)
        return embedded @ embedded.T


class BiasedSimilarities(Similarities):
    """The scores plus a per-example bias: the whole product would meet this replica's
    examples alone, so gathering its operands over replicas cannot make it exact."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        embedded = self.layers(x)
        return embedded @ embedded.T + embedded[:, :1]


TWO_CPUS = Mesh.cluster("cpu", nodes=1, per_node=2)
FOUR_CPUS = Mesh.cluster("cpu", nodes=1, per_node=4)
IMAGES = torch.randn(8, 3, 4, 4)


def test_a_model_that_mixes_its_examples_is_planned_on_the_whole_batch():
    plan = autopart.plan(BiasedSimilarities(), TWO_CPUS, (IMAGES,))
    assert (plan.dp, plan.microbatches) == (1, 1)
    # A pipeline of one microbatch runs GPipe: 1F1B needs pp microbatches.
    piped = autopart.plan(BiasedSimilarities(), TWO_CPUS, (IMAGES,), pp=2)
    assert (piped.pp, piped.microbatches, piped.schedule) == (2, 1, "gpipe")


@pytest.mark.parametrize("pins", [{"dp": 2}, {"dp": 2, "zero": 3}, {"microbatches": 2}])
def test_pins_that_split_the_batch_of_such_a_model_are_refused_saying_where(pins):
    with pytest.raises(
        autopart.PlanError, match=r"mixes the examples of a batch: matmul gives a batch × batch"
    ):
        autopart.plan(BiasedSimilarities(), TWO_CPUS, (IMAGES,), **pins)


@pytest.mark.parametrize("pins", [{"dp": 2}, {"dp": 2, "zero": 3}])
def test_a_batch_by_batch_product_splits_over_replicas_one_microbatch_each(pins):
    """The batch-products rewrite gathers its operands over the replicas
    (passes/batch_products.py): dp splits the batch, microbatches do not."""
    plan = autopart.plan(Similarities(), TWO_CPUS, (IMAGES,), **pins)
    assert (plan.dp, plan.microbatches, plan.batch_product_loss) == (2, 1, "whole")
    with pytest.raises(autopart.PlanError, match="microbatches=2 would split each replica"):
        autopart.plan(Similarities(), TWO_CPUS, (IMAGES,), microbatches=2, **pins)


@pytest.mark.parametrize("pins", [{"dp": 2}, {"dp": 2, "zero": 3}])
def test_batch_norms_split_over_replicas_one_microbatch_each(pins):
    """The batch-norm rewrite reduces their statistics over the replicas
    (passes/batch_norm.py): dp splits the batch, microbatches do not."""
    plan = autopart.plan(BatchNormNet(), TWO_CPUS, (IMAGES,), **pins)
    assert (plan.dp, plan.microbatches) == (2, 1)


@pytest.mark.parametrize("pins", [{"microbatches": 2}, {"pp": 2, "microbatches": 2}])
def test_microbatches_of_a_batch_norm_model_are_refused_unless_per_part(pins):
    with pytest.raises(
        autopart.PlanError,
        match=r"microbatches=2 would split each replica's batch, .* batch_norm .* at layers\.1",
    ) as refused:
        autopart.plan(BatchNormNet(), TWO_CPUS, (IMAGES,), **pins)
    assert "per_part_statistics=True" in str(refused.value)
    accepted = autopart.plan(BatchNormNet(), TWO_CPUS, (IMAGES,), per_part_statistics=True, **pins)
    assert accepted.microbatches == 2
    assert "as DDP without SyncBatchNorm does" in accepted.explain()


def test_axes_pinned_so_that_dp_must_split_such_a_batch_are_refused():
    with pytest.raises(autopart.PlanError, match="dp=4 would split the batch"):
        autopart.plan(BiasedSimilarities(), FOUR_CPUS, (IMAGES,), tp=1, pp=1, cp=1, ep=1)


class PairScores(nn.Module):
    """A batch × batch product of one projection, plus a per-example bias (which keeps
    its batch whole): too few segments for pp=4."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(48, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        embedded = self.proj(x.flatten(1))
        return embedded @ embedded.T + embedded[:, :1]


def test_with_no_plan_on_the_whole_batch_the_refusal_says_why():
    with pytest.raises(autopart.PlanError, match=r"the batch stays whole \(dp=1, one microbatch\)"):
        autopart.plan(PairScores(), FOUR_CPUS, (IMAGES,), tp=1)


@pytest.mark.slow  # a large model planned with and without room
def test_offload_is_chosen_only_where_nothing_fits_on_the_device():
    """ZeRO offload (the optimizer state in host memory, stepped there) is the solver's
    last resort: chosen where no plan keeping the state on the device fits, and not
    otherwise. On 2 ranks, ZeRO-2 with offload holds 4 + 4/2 bytes a parameter on the
    device, less than ZeRO-3's 16/2."""
    mesh = Mesh.cluster("cpu", nodes=1, per_node=2)
    captured = capture(tiny_gpt2(), (token_batch(2)[0],))
    analyze(captured.gm, captured.context())
    on_device = Choices(2, Degrees(dp=2), zero=3)
    offloaded = Choices(2, Degrees(dp=2), zero=2, offload=True)
    tight = _memory_between(captured, mesh, on_device, offloaded)
    pins = {"dp": 2, "tp": 1, "pp": 1, "microbatches": 1, "recompute": "none"}
    plan = make_plan(captured, tight, Pins.of(**pins))
    assert plan.offload and plan.zero in (1, 2)
    assert plan.predicted.peak_memory_bytes <= tight.device.memory_bytes
    assert "ZeRO offload" in plan.explain()
    assert not make_plan(captured, mesh, Pins.of(**pins)).offload  # room on the device
    with pytest.raises(ValueError, match="no plan fits"):
        make_plan(captured, tight, Pins.of(offload=False, **pins))


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_the_gathers_zero3_cannot_hide_are_charged(model):
    """What a plan's fitted floor adds under ZeRO-3 (`unhidden_gathers`: the gathers
    each rank's forward cannot hide, and the step's own work) `predict` charges at
    least, for the plan the inner model makes at memory limits from roomy to where
    blocks are recomputed, on links slow enough that the gathers outlast the compute:
    the slowest rank's microbatch is at least the least pace with the former, the step
    at least its microbatches, its bubble and the latter."""
    from autopart.cost_models import CostModels
    from autopart.cost_models.predict import (
        once_per_step_floor,
        rank_segments,
        unhidden_gathers,
    )
    from autopart.cost_models.stage_costs import stage_problem_of
    from autopart.cost_models.summary import GraphSummary
    from autopart.solver.search import _fitted_beyond, _fitted_floor, _inner
    from autopart.solver.stage_model import pace_lower_bound

    captured = capture(LM_FACTORIES[model](layers=8), (token_batch(32)[0],))
    analyze(captured.gm, captured.context())
    summary = GraphSummary(captured.gm)
    slow = replace(Mesh.cluster("a100-80g", nodes=8, per_node=1).device, inter_node_bandwidth=1e8)
    fitted = 0
    for pp, schedule, m in itertools.product((2, 4), ("1f1b", "interleaved-1f1b"), (4, 8)):
        virtual = 2 if schedule == "interleaved-1f1b" else 1
        choices = Choices(32, Degrees(pp=pp, dp=8 // pp), 3, m, schedule, virtual)
        mesh = Mesh.cluster(slow, nodes=8, per_node=1)
        models = CostModels.of(mesh, choices.precision)
        plain = predict(summary, mesh, choices, models=models)
        segments = rank_segments(summary, {"batch": choices.microbatch_size}, choices)
        unhidden = unhidden_gathers(segments, choices, models)
        assert unhidden is not None
        params = sum(s.param_numel() for s in segments)
        per_step = once_per_step_floor(params, choices, models)
        for fraction in (2.0, 1.0, 0.9, 0.8, 0.7):
            memory = int(plain.peak_memory_bytes * fraction)
            small = Mesh.cluster(replace(slow, memory_bytes=memory), nodes=8, per_node=1)
            problem = stage_problem_of(summary, choices, {}, models, memory, recomputable=True)
            floor = _fitted_floor(problem, choices)
            for line in (floor / 2, floor * (1 - 1e-12), floor, floor * (1 + 1e-12), 2 * floor):
                # The search's one test of the bound, as the bound itself tells.
                assert _fitted_beyond(problem, choices, line) == (floor > line), (choices, line)
            c, price = _inner(problem, summary, small, choices, plain, {}, models)
            if not c.stage_cuts or price.peak_memory_bytes > memory:
                continue
            fitted += 1
            tick = problem.time_unit_s
            extra = [int(seconds // tick) for seconds in unhidden]
            pace = pace_lower_bound(problem, extra) * tick * (1 - 1e-4)
            slowest = max(s.microbatch_s for s in price.stages)
            assert pace_lower_bound(problem) * tick < pace <= slowest, (
                choices,
                fraction,
            )
            once = price.step_time_s - m * slowest - price.bubble_s
            assert 0 < per_step <= once * (1 + 1e-9), (choices, fraction)
    assert fitted


def test_free_tensor_parallelism_keeps_its_groups_inside_a_node():
    """tp groups are consecutive ranks: on nodes of 8, tp 3 or 6 (which divide a world of
    24) would put a group across two nodes, its collectives on the network. Free, tp
    takes only the degrees that divide the node; pinned, it is the user's to choose."""
    mesh = Mesh.cluster("a100-80g", nodes=3, per_node=8)

    def tp_degrees(pins: Pins) -> set[int]:
        return {
            d["tp"]
            for d in Degrees.factorizations(mesh.world_size, pins.degrees)
            if _admissible(d, mesh, pins, batch=48, blocks=4, sequence=None)
        }

    assert tp_degrees(Pins.of()) == {1, 2, 4, 8}
    assert tp_degrees(Pins.of(tp=3)) == {3}


def _candidate(step_ms: float, **choices) -> Candidate:
    predicted = Predicted(step_ms / 1e3, step_ms / 1e3, 0.0, 0.0, peak_memory_bytes=GiB)
    return Candidate(Choices(global_batch=8, **choices), predicted)


def test_a_pipeline_and_tensor_parallelism_count_alike_within_the_slack():
    """A pipeline's microbatches are its own: priced 2% faster than tp2, the pipeline is
    chosen, where counting them as gradient accumulation would keep tp2."""
    tp = _candidate(100, degrees=Degrees(tp=2))
    pp = _candidate(98, degrees=Degrees(pp=2), microbatches=2, schedule="1f1b")
    assert pp.simplicity == tp.simplicity
    assert _solve([tp, pp], 2 * GiB) is pp


def test_gradient_accumulation_without_a_pipeline_still_counts():
    plain = _candidate(100, degrees=Degrees(dp=2))
    accumulated = _candidate(98, degrees=Degrees(dp=2), microbatches=2)
    assert accumulated.simplicity == plain.simplicity + 1
    assert _solve([accumulated, plain], 2 * GiB) is plain


def test_context_parallel_plans_whose_states_overflow_are_not_made():
    """On a large mesh most plans with context parallelism hold more parameters,
    gradients and optimizer state than a device has (`_states_overflow`), which the
    search would leave unpriced: `_choices` does not make them, and makes every other
    plan, in the same order. Llama-3-8B's shape at 128k tokens on 8 nodes of 8 H100s."""
    from autopart.api import captured_for_planning
    from autopart.cost_models import CostModels
    from autopart.solver.search import _choices, _states_overflow, _StatesFit
    from autopart.solver.tp_layouts import TpLayouts
    from tests.models import llama3_8b_on_meta

    tokens = 131072
    ids = torch.zeros(2, tokens, dtype=torch.long, device="meta")
    captured = captured_for_planning(llama3_8b_on_meta(positions=tokens), (ids,))
    mesh = Mesh.cluster("h100-80g", nodes=8, per_node=8)
    dims = {k: v for k, v in captured.dim_sizes.items() if k != "batch"}
    pins = Pins.of(precision="bf16-mixed")
    layouts = TpLayouts(captured.gm, captured.parameter_names, mesh, dims, pins.precision)
    first = layouts.summary(1).evaluate({**dims, "batch": 1})
    blocks = tuple(s.key for s in first if s.is_block)
    every = list(_choices(layouts, mesh, pins, 2, blocks))
    fit = _StatesFit(layouts, mesh, pins, dims, offload=False)
    made = list(_choices(layouts, mesh, pins, 2, blocks, fit=fit))
    models = CostModels.of(mesh, pins.precision)
    memory = mesh.device.memory_bytes

    def overflows(c: Choices) -> bool:
        summary = layouts.summary(c.tp, c.sequence_parallel)
        return _states_overflow(summary, c, dims, models, memory, {})

    kept = [c for c in every if c.cp == 1 or not overflows(c)]
    assert made == kept
    assert any(c.cp > 1 for c in made) and len(made) < len(every)


def test_memory_costs_a_layout_nothing_where_the_model_fits_many_times_over():
    """The tp layout model prices memory at what recomputation takes to free it, so on
    a slow device it holds the head's shard and gathers it at every use. Where one
    device's plan fits in half the device's memory (`memory_may_bind`), no plan needs
    that: the free search's layouts take the least time and gather no weight at its
    use. Pinned, tp shards as the layout model prices it."""
    from autopart.solver.tp_layouts import TpLayouts, memory_may_bind
    from tests import random_models

    torch.manual_seed(0)
    model = random_models.RandomLM(random_models.Case(64, 8192, ("mlp",) * 4, False, (), 0, 16))
    ids = torch.randint(0, 8192, (4, 16))
    cpu = Mesh.cluster("cpu", nodes=1, per_node=2).device
    slow = replace(cpu, peak_flops={"fp32": 1e9}, memory_bandwidth=1e9)
    captured = capture(model, (ids,))
    analyze(captured.gm, captured.context())
    dims = {k: v for k, v in captured.dim_sizes.items() if k != "batch"}
    for memory, binds in ((slow.memory_bytes, False), (32 * 2**20, True)):
        mesh = Mesh.cluster(replace(slow, memory_bytes=memory), nodes=1, per_node=2)
        layouts = TpLayouts(captured.gm, captured.parameter_names, mesh, dims)
        assert memory_may_bind(layouts, mesh, Pins(), 4, dims) is binds
    mesh = Mesh.cluster(slow, nodes=1, per_node=2)
    pinned = autopart.plan(model, mesh, (ids,), loss_fn=random_models.loss, tp=2)
    free = autopart.plan(model, mesh, (ids,), loss_fn=random_models.loss)
    assert "gathered when used" in pinned.tp_roles.values()
    assert free.tp == 2 and "gathered when used" not in free.tp_roles.values()


def test_ranks_each_run_the_whole_step_where_splitting_the_batch_costs_more():
    """A tp whose layout shards nothing runs one device's step on every rank, with no
    collective: on a tiny model over slow links, faster than dp2's gradient all-reduce,
    and chosen; over the preset's links dp2 is faster and chosen. The plan says so."""
    ids, _ = token_batch(batch=8)
    slow = Mesh.cluster(slow_links_cpu(), nodes=1, per_node=2)
    replicated = autopart.plan(tiny_gpt2(), slow, (ids,), loss_fn=lm_loss)
    assert (replicated.tp, replicated.dp, replicated.tp_shards_nothing) == (2, 1, True)
    assert replicated.predicted.exposed_comm_s == 0
    assert "tp=2 shards nothing: each of its ranks runs the whole step" in str(replicated)
    split = autopart.plan(tiny_gpt2(), TWO_CPUS, (ids,), loss_fn=lm_loss)
    assert (split.tp, split.dp) == (1, 2)
