"""The inner CP-SAT (stage cuts and recomputation) against a brute-force enumeration of
the same space under the same costs: every cut combination times every assignment of
none, whole-block or attention-core recomputation to every block, not only counts per
chunk."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction
from itertools import combinations, product

import pytest

from autopart.capture import capture
from autopart.cost_models import Choices, CostModels, predict
from autopart.cost_models.stage_costs import (
    StageAssignment,
    StageProblem,
    Unit,
    evaluate,
    stage_problem_of,
)
from autopart.cost_models.summary import GraphSummary
from autopart.degrees import Degrees
from autopart.mesh import Mesh
from autopart.passes import analyze
from autopart.solver.stage_model import pace_lower_bound, pace_within, solve_stages
from tests.models import LM_FACTORIES, token_batch


def brute_force(problem: StageProblem) -> StageAssignment | None:
    """The least (pace, added recomputation) over every assignment that fits."""
    options = [
        ("none", "whole", "core") if u.has_attention_core else ("none", "whole")
        for u in problem.units
        if u.kind is not None
    ]
    recomputable = [i for i, u in enumerate(problem.units) if u.kind is not None]
    assignments = [
        tuple(
            frozenset(i for i, c in zip(recomputable, choice) if c == k) for k in ("whole", "core")
        )
        for choice in product(*options)
    ]
    best = None
    for starts in combinations(problem.cut_positions, problem.chunks - 1):
        for whole, core in assignments:
            a = evaluate(problem, starts, whole, core)
            better = best is None or (a.pace, a.added) < (best.pace, best.added)
            if a.fits(problem.memory) and better:
                best = a
    return best


def _assert_optimal(problem: StageProblem) -> StageAssignment | None:
    """The CP-SAT's choice is the brute force's, and the bound the search refuses
    candidates by (`pace_lower_bound`) is at most its pace."""
    chosen = solve_stages(problem)
    best = brute_force(problem)
    if best is None:
        assert chosen is None
        return None
    assert chosen is not None and chosen.fits(problem.memory)
    assert (chosen.pace, chosen.added) == (best.pace, best.added)
    assert pace_lower_bound(problem) <= best.pace
    return chosen


def _synthetic(memory: int, pp: int = 2, chunks: int = 2, schedule_depth: bool = True):
    """An embedding, six blocks, a head: a block takes 0.1 ms (recomputing it 0.03 ms
    more, its attention core alone 0.005 ms) and saves 100 bytes (10 kept when
    recomputed, 40 when its core alone is); 1F1B's in-flight counts."""
    embed = Unit("embed", None, time=30_000, states=800, saved=20)
    head = Unit("head", None, time=60_000, states=800, saved=40)
    blocks = [
        Unit(f"layers.{i}", "layers#0", 100_000, 160, 100, 30_000, 10, 0, 5_000, 60)
        for i in range(6)
    ]
    units = (embed, *blocks, head)
    in_flight = tuple(Fraction(pp - r if schedule_depth else 1) for r in range(pp))
    return StageProblem(
        units=units,
        pp=pp,
        chunks=chunks,
        cut_positions=tuple(range(2, 7)),
        in_flight=in_flight,
        bucket=0,
        fixed=(0,) * pp,
        comm=(0,) * pp,
        allocator=Fraction(1, 10),
        memory=memory,
    )


def _memory_grid(memories: list[int], slow: set[int]) -> list:
    """(memory, pp, chunks) over every shape. The limits in `slow`, and the limits
    between the extremes for the largest brute force (pp=2 over 4 chunks), run with the
    slow sweeps."""
    grid = []
    for pp, chunks in [(1, 1), (2, 2), (3, 3), (2, 4)]:
        for memory in memories:
            largest = (pp, chunks) == (2, 4) and memory not in (memories[0], memories[-1])
            marks = [pytest.mark.slow] if memory in slow or largest else []
            grid.append(pytest.param(memory, pp, chunks, marks=marks))
    return grid


LIMITS = [10**9, 2_100, 2_000, 1_900, 1_800, 1_700, 1_500, 100]


@pytest.mark.parametrize("memory, pp, chunks", _memory_grid(LIMITS, {2_000, 1_700}))
def test_synthetic_problems_match_brute_force(memory, pp, chunks):
    _assert_optimal(_synthetic(memory, pp, chunks))


def test_the_pace_bound_prices_the_recomputation_memory_forces():
    """Two ranks, memory for every block only if some are recomputed: the bound rises
    above the pace with room to spare, and stays at most the optimum."""
    tight, roomy = brute_force(_synthetic(1_700)), brute_force(_synthetic(10**9))
    assert tight is not None and roomy is not None and tight.pace > roomy.pace
    assert roomy.pace < pace_lower_bound(_synthetic(1_700)) <= tight.pace


def test_the_pace_bound_is_infinite_where_no_block_fits():
    assert brute_force(_synthetic(1_500)) is None
    assert pace_lower_bound(_synthetic(1_500)) == float("inf")


@pytest.mark.parametrize("memory", [10**9, 1_700, 1_500])
def test_one_test_of_the_relaxation_tells_a_pace_from_the_bound(memory):
    """`pace_within` answers whether the bound is at most a pace, at every pace around
    it, as the search asks it in place of the bound."""
    problem = _synthetic(memory)
    bound = pace_lower_bound(problem)
    finite = int(bound) if bound < float("inf") else 10**6
    for pace in [-1, 0, finite - 2, finite - 1, finite, finite + 1, 10**7]:
        assert pace_within(problem, pace) == (bound <= pace), pace


def _encoder_decoder(memory: int, pp: int, chunks: int) -> StageProblem:
    """Two kinds of blocks with a segment between them (an encoder, a bridge, a
    decoder): the general formulation, with element constraints."""
    encoder = [
        Unit(f"enc.{i}", "enc#0", 80_000, 165, 90, 20_000, 10, 40, 4_000, 50) for i in range(3)
    ]
    bridge = Unit("bridge", None, time=10_000, states=330, saved=30, grads=80)
    decoder = [Unit(f"dec.{i}", "dec#1", 120_000, 231, 130, 40_000, 10, 56) for i in range(3)]
    units = (*encoder, bridge, *decoder)
    return StageProblem(
        units=units,
        pp=pp,
        chunks=chunks,
        cut_positions=(1, 2, 4, 5, 6),
        in_flight=tuple(Fraction(pp - r) for r in range(pp)),
        bucket=40,
        fixed=(5,) * pp,
        comm=tuple(1_000 * (r + 1) for r in range(pp)),
        allocator=Fraction(1, 10),
        memory=memory,
    )


@pytest.mark.parametrize("memory", [10**9, 1_500, 1_300, 1_200, 1_100, 900, 100])
@pytest.mark.parametrize("pp,chunks", [(1, 1), (2, 2), (3, 3), (2, 4)])
def test_two_kinds_of_blocks_match_brute_force(memory, pp, chunks):
    _assert_optimal(_encoder_decoder(memory, pp, chunks))


def test_memory_moves_the_cut_and_recomputes_only_where_needed():
    ample = _assert_optimal(_synthetic(10**9))
    tight = _assert_optimal(_synthetic(2_000))
    tighter = _assert_optimal(_synthetic(1_700))
    assert ample is not None and tight is not None and tighter is not None
    # Recomputation only costs time when memory is ample.
    assert not ample.recomputed and not ample.attention
    # Where recomputing attention cores frees enough, they are chosen over whole blocks
    # (a sixth of the time); the first rank holds two microbatches in flight, the
    # second one, so it recomputes more.
    assert not tight.recomputed and 0 < len(tight.attention) < 6
    first = sum(i < tight.starts[0] for i in tight.attention)
    assert first >= len(tight.attention) - first
    # Tighter still, some blocks are recomputed whole.
    assert tighter.recomputed


@pytest.fixture(scope="module", params=["gpt2", "llama", "gpt2-eager"])
def tiny_summary(request):
    model = LM_FACTORIES[request.param](layers=4)
    captured = capture(model, (token_batch(8)[0],))
    analyze(captured.gm, captured.context())
    return GraphSummary(captured.gm)


@pytest.mark.parametrize(
    "degrees,zero,schedule,microbatches,virtual",
    [
        (Degrees(dp=2, pp=2), 0, "1f1b", 4, 1),
        (Degrees(dp=1, pp=4), 0, "1f1b", 8, 1),
        (Degrees(dp=2, pp=2), 1, "interleaved-1f1b", 4, 2),
        (Degrees(dp=4, pp=1), 2, None, 2, 1),
    ],
)
def test_tiny_models_match_brute_force_at_several_memory_limits(
    tiny_summary, degrees, zero, schedule, microbatches, virtual
):
    mesh = Mesh.cluster("h100-80g", nodes=1, per_node=degrees.world_size)
    choices = Choices(8, degrees, zero, microbatches, schedule, virtual)
    models = CostModels.of(mesh, choices.precision)
    roomy = stage_problem_of(tiny_summary, choices, {}, models, 10**12, recomputable=True)
    unlimited = evaluate(roomy, roomy.cut_positions[: roomy.chunks - 1], frozenset())
    peak = max(unlimited.peaks)
    for fraction in (1.0, 0.9, 0.8, 0.7, 0.5):
        problem = stage_problem_of(
            tiny_summary, choices, {}, models, int(peak * fraction), recomputable=True
        )
        _assert_optimal(problem)


@pytest.mark.parametrize(
    "degrees,zero",
    [
        (Degrees(dp=2, pp=2), 0),
        (Degrees(dp=2, pp=2), 1),
        (Degrees(dp=2, pp=2), 2),
        (Degrees(cp=2, pp=2), 0),
    ],
)
def test_the_inner_memory_agrees_with_predict(tiny_summary, degrees, zero):
    """The inner model's linear memory (stage_costs) is `predict`'s, rank by rank, for
    the assignment it chooses: the two must not drift apart (under context parallelism
    too, where a rank holds its share of the tokens but for what runs whole)."""
    mesh = Mesh.cluster("h100-80g", nodes=1, per_node=4)
    choices = Choices(8, degrees, zero, 4, "1f1b")
    models = CostModels.of(mesh, choices.precision)
    plain = predict(tiny_summary, mesh, choices, models=models).peak_memory_bytes
    # The roomiest limit at which the inner model recomputes blocks to fit.
    for fraction in (0.95, 0.9, 0.85, 0.8, 0.75):
        memory = int(plain * fraction)
        problem = stage_problem_of(tiny_summary, choices, {}, models, memory, recomputable=True)
        chosen = solve_stages(problem)
        if chosen is not None and chosen.recomputed:
            break
    assert chosen is not None and chosen.recomputed
    units = problem.units
    priced = predict(
        tiny_summary,
        mesh,
        replace(
            choices,
            stage_cuts=tuple(units[i].key for i in chosen.starts),
            recompute=tuple(units[i].key for i in sorted(chosen.recomputed)),
            recompute_attention=tuple(units[i].key for i in sorted(chosen.attention)),
        ),
        models=models,
    )
    byte = memory / problem.memory
    for inner, stage in zip(chosen.peaks, priced.stages):
        assert inner * byte == pytest.approx(stage.peak_memory_bytes, rel=0.02)


def test_problems_made_with_shared_models_are_those_made_alone(tiny_summary):
    """The search builds thousands of problems with one `CostModels`, which keeps what
    plans share (their units, ranks in flight and sends): each problem is the one its
    plan gets from models of its own, whatever was built before it."""
    mesh = Mesh.cluster("h100-80g", nodes=1, per_node=4)
    shared = CostModels.of(mesh, "fp32")
    plans = [
        Choices(8, Degrees(dp=2, pp=2), zero, m, schedule, virtual, recompute=recompute)
        for zero in (0, 3)
        for m, schedule, virtual in ((2, "1f1b", 1), (4, "1f1b", 1), (4, "interleaved-1f1b", 2))
        for recompute in ((), ("model.layers.0",))
    ]
    plans += [Choices(8, Degrees(dp=1, pp=4), 0, 4, "1f1b"), Choices(8, Degrees(dp=4), 2, 2)]
    for choices in plans:
        for memory, recomputable in ((10**12, True), (10**9, False)):
            alone = CostModels.of(mesh, "fp32")
            made = stage_problem_of(tiny_summary, choices, {}, shared, memory, recomputable)
            own = stage_problem_of(tiny_summary, choices, {}, alone, memory, recomputable)
            assert made == own, choices
            assert [u.key for u in made.units] == [u.key for u in own.units]
