"""Searching the plans the pins leave open, with OR-Tools CP-SAT.

Candidates, every combination the pins allow:
  every factorization of the mesh over the axes of `Degrees` (pp × dp × ep × cp × tp),
    less what `_admissible` rules out for an unpinned axis: dp × ep must divide the
    batch, ep the experts of every routed layer (with cp = 1), tp stays within a node
    (tensor parallelism on the fast links; where its layout shards nothing, its ranks
    each run the whole step, with no collective); pp no more than the repeated
    blocks; cp where the model attends over a sequence that splits into 2·cp chunks,
    and where a microbatch holds fewer sequences per replica than cp (otherwise dp·cp
    replicas of whole sequences do the same work for less). An axis with no rule is
    enumerated at every degree;
  ZeRO stage 0-3 (0 when dp = 1);
  sequence parallelism where tp > 1, as pinned, else where the layout model finds it
    pays (`TpLayouts.sequence_parallel`: the layout solved with and without it);
  microbatches: every count giving a power-of-two microbatch size that divides the
    replica's batch (gradient accumulation without a pipeline too); schedule 1F1B,
    and interleaved 1F1B over 2 to MAX_VIRTUAL_STAGES virtual stages where the blocks
    allow (GPipe where one microbatch is pinned);
  no recomputation, unless pinned (whole blocks, or their attention cores alone).
Each is priced once by `cost_models.predict` on one `GraphSummary` of the graph. A
pipeline's stage cuts, and the blocks to recompute (whole, or their attention cores
alone) when a plan does not fit otherwise, at any ZeRO stage, are decided per candidate
by the inner CP-SAT model (`stage_model.py`) and the result priced again.

Formulation. A boolean x_c per candidate c, with predicted step time t_c (µs), peak
memory m_c (bytes), a simplicity rank s_c (how many mechanisms it switches on) and
its rank r_c among the N candidates by step time:

    add_one_plan:      Σ_c x_c = 1
    add_memory:        Σ_c m_c x_c ≤ M          (M: the device's memory)
    objective 1:       minimize Σ_c t_c x_c      → T*
    add_near_fastest:  Σ_c t_c x_c ≤ (1 + slack) T*
    objective 2:       minimize Σ_c (N s_c + r_c) x_c

The second solve keeps the simplest of the plans within `slack` (5%) of the fastest, so
plain data parallelism stays when nothing is measurably faster: correct first, then
fast. Simplicity counts mechanisms (an axis switched on, the ZeRO stage, recomputation,
interleaving, gradient accumulation outside a pipeline, sequence parallelism), not
degrees; among equally simple plans, the fastest, so the choice does not depend on the
order in which candidates are enumerated. The solver runs on one worker with a fixed
seed, so it is deterministic, and logs the problem size and solve time.
"""

from __future__ import annotations

import heapq
import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ortools.sat.python import cp_model

from autopart.batch import BATCH
from autopart.cost_models import (
    Choices,
    CostModels,
    GraphSummary,
    predict,
    step_time_lower_bound,
)
from autopart.cost_models.pipeline import bubble_fraction
from autopart.cost_models.predict import (
    balanced_pipeline_floors,
    once_per_step_floor,
    rank_segments,
    unhidden_gathers,
)
from autopart.cost_models.stage_costs import StageProblem, stage_problem_of
from autopart.degrees import Axis, Degrees
from autopart.mesh import Mesh
from autopart.plan import Predicted
from autopart.plan_format import format_bytes
from autopart.policy import (
    CHOICE_SLACK,
    LOW_DTYPES,
    MAX_ALTERNATIVES,
    MasterWeights,
    Schedule,
    offload_refusal,
    param_dtype_refusal,
    zero_refusal,
)
from autopart.solver.pipeline import microbatches_problem
from autopart.solver.stage_model import pace_lower_bound, pace_within, solve_stages
from autopart.solver.tp_layouts import TpLayouts

if TYPE_CHECKING:
    from autopart.solver.pins import Pins

log = logging.getLogger("autopart.solver")

PROGRESS_EVERY_S = 2.0  # a solve longer than this reports how far it has got


class Progress:
    """Logs `what` and how many of `total` are done, at most every PROGRESS_EVERY_S
    seconds, so a long solve shows it is moving (the CLI prints autopart's INFO log)."""

    def __init__(self, what: str, total: int) -> None:
        self.what, self.total = what, total
        self.start = self.last = time.perf_counter()

    def update(self, done: int) -> None:
        now = time.perf_counter()
        if now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            log.info("%s: %d of %d (%.0f s)", self.what, done, self.total, now - self.start)


SLACK = CHOICE_SLACK
# How much faster the inner model's stage cuts can make a pipeline than the cuts balanced
# by compute that the search prices first: measured on Llama-3-8B's candidates, at most
# 1e-4; a margin, so that no plan the inner model could make the fastest is skipped.
REBALANCE_GAIN = 0.02
SEED = 0
# The most virtual stages per rank the search tries for interleaved 1F1B: Llama 3's
# 405B run cut 126 blocks into 16 × 8 chunks (Llama Team, 2024, section 3.3.2); beyond
# it the bubble has shrunk by 8× and the transfers grow on.
MAX_VIRTUAL_STAGES = 8
# What switching an axis on (degree > 1) adds to a plan's complexity (3 where not named):
# data parallelism adds none, so it is preferred among near-equal plans.
AXIS_COMPLEXITY = {Axis.DP: 0}
# ZeRO's, by stage: stages 1 and 2 shard the optimizer's side of the step alike (the
# same bytes cross the links: a reduce-scatter and an all-gather where stage 0 runs an
# all-reduce); stage 3 also gathers the parameters around every use.
ZERO_COMPLEXITY = {0: 0, 1: 1, 2: 1, 3: 2}


class NoPlanFits(ValueError):
    """Every plan the pins allow exceeds the device's memory."""


@dataclass(frozen=True, slots=True)
class Candidate:
    choices: Choices
    predicted: Predicted
    # Why the optimizer state is offloaded, where the search chose that: what the
    # smallest plan keeping it on the device would need.
    offload_reason: str = ""

    @property
    def simplicity(self) -> int:
        """How many mechanisms the plan switches on. Degrees do not count: between
        plans that use the same mechanisms (pp=8 and pp=16, both with tp and
        recomputation), the cost model's figures decide, not a preference. A
        pipeline's microbatches are the pipeline's own, not gradient accumulation
        besides it: counted, every pipeline would rank below a tp plan of the same
        degrees within the slack, however much faster it was priced."""
        c = self.choices
        axes = sum(AXIS_COMPLEXITY.get(a, 3) for a, n in c.degrees.items() if n > 1)
        return (
            ZERO_COMPLEXITY[c.zero]
            + axes
            + 2 * bool(c.recompute)
            + bool(c.recompute_attention)
            + (c.virtual_stages > 1)
            + (c.microbatches > 1 and c.degrees[Axis.PP] == 1)
            + c.sequence_parallel
        )


def search(
    layouts: TpLayouts, mesh: Mesh, pins: Pins, global_batch: int, dims: Mapping[str, int]
) -> list[Candidate]:
    """The chosen candidate first, then the other plans that fit, fastest first."""
    first = layouts.summary(1).evaluate({**dims, BATCH: 1})
    blocks = tuple(s.key for s in first if s.is_block)
    recomputable = pins.recompute is None and pins.recompute_attention is None

    def priced(offload: bool) -> list[Candidate]:
        # Plans with context parallelism go last, against the best plan without it:
        # there are many, and a pipeline's best plan is often found only once the
        # inner model fits it, after which the floor prunes most of them.
        fit = _StatesFit(layouts, mesh, pins, dims, offload)
        choices = list(_choices(layouts, mesh, pins, global_batch, blocks, offload, fit))
        listed = _Listed()
        without = [c for c in choices if c.cp == 1]
        found = _price(layouts, mesh, dims, without, recomputable, listed=listed)
        best = min(
            (c.predicted.step_time_s for c in found if c.predicted.peak_memory_bytes <= memory),
            default=math.inf,
        )
        with_cp = [c for c in choices if c.cp > 1]
        return found + _price(layouts, mesh, dims, with_cp, recomputable, best, listed)

    memory = mesh.device.memory_bytes

    candidates = priced(offload=bool(pins.offload))
    if not candidates:
        raise NoPlanFits("the pins leave no plan that divides the batch and the mesh")
    try:
        chosen = _solve(candidates, mesh.device.memory_bytes)
    except NoPlanFits as on_device:
        # Nothing fits with the optimizer state on the device: offload it, unless the
        # pins say where it lives.
        offloaded = priced(offload=True) if pins.offload is None else []
        if not offloaded:
            raise
        try:
            chosen = _solve(offloaded, mesh.device.memory_bytes)
        except NoPlanFits as e:
            hint = _host_masters_hint(layouts, mesh, pins, global_batch, dims, blocks)
            raise NoPlanFits(
                f"{on_device}. With the optimizer state offloaded: {e}{hint}"
            ) from None
        reason = _shortfall(candidates, memory)
        candidates = [replace(c, offload_reason=reason) for c in offloaded]
        chosen = candidates[offloaded.index(chosen)]
    if chosen.choices.pp > 1 and not chosen.choices.stage_cuts:
        chosen = _with_inner_cuts(layouts, mesh, chosen, dims)
    fitting = [c for c in candidates if c.predicted.peak_memory_bytes <= mesh.device.memory_bytes]
    others = sorted((c for c in fitting if c is not chosen), key=lambda c: c.predicted.step_time_s)
    return [chosen, *others]


def _price(
    layouts: TpLayouts,
    mesh: Mesh,
    dims: Mapping[str, int],
    choices: list[Choices],
    recomputable: bool,
    best: float = math.inf,
    listed: _Listed | None = None,
) -> list[Candidate]:
    """The choices priced best first. Each is priced by `predict` (a pipeline cut where
    blocks balance its compute, nothing recomputed) and, where it does not fit, fitted
    by the inner model (`_inner`), which cuts the pipeline and recomputes blocks to fit
    memory. Both are done least bound first: a plan's step floor before it is priced
    (`step_time_lower_bound`: the ranks' summed work in the least span any split of it
    allows), its price before it is fitted (the inner model only adds
    time, its cuts but for `REBALANCE_GAIN`). A pipeline whose memory floor
    (`_price_floors`) says it cannot fit as `predict` cuts it goes to be fitted
    unpriced, bound by its step's floor: most such plans the inner model cannot bring
    within the slack, and a price would only say so. Once the least bound left is slower than
    (1 + SLACK) × the fastest fitting plan found (or `best`, a step time already
    found), what is left can be neither chosen nor within the slack of the choice: a
    plan is left unpriced, or unfitted. A plan whose fitted floor (`_fitted_floor`) is
    beyond the slack is left unfitted too. A plan is left unpriced or unfitted by
    tighter floors (`_price_floors`, `_unfitted`) only where it could not be listed among
    the alternatives either (`_Listed`): the search order, and so what is chosen and
    listed, stays what the first floors make it.

    A plan whose parameters, gradients and optimizer state alone exceed the device's
    memory (`_states_overflow`) fits whatever the inner model does: it is priced only
    where no other plan fits, for the refusal to say how close the smallest came
    (and not at all under context parallelism, which has the plans without it)."""
    start, memory = time.perf_counter(), mesh.device.memory_bytes
    if not choices:
        return []
    listed = listed if listed is not None else _Listed()
    models = CostModels.of(mesh, choices[0].precision, choices[0].compiled)
    floors: dict = {}  # step_time_lower_bound's cache
    held: dict = {}  # _states_overflow's
    hopeless: list[Choices] = []
    # The work left, least bound first: (bound, 0, i) a plan to price, its bound its
    # step floor; (bound, 1, i) a priced plan that does not fit, to fit, its bound the
    # least the inner model can make of its step.
    queue: list[tuple[float, int, int]] = []
    for i, c in enumerate(choices):
        summary = layouts.summary(c.tp, c.sequence_parallel)
        if _states_overflow(summary, c, dims, models, memory, held):
            if c.cp == 1:
                hopeless.append(c)
            continue
        # Under context parallelism the floor without its layout, which is cheap to make.
        floor = step_time_lower_bound(summary, c, dims, models, floors, cp_layout=c.cp == 1)
        queue.append((floor, 0, i))
    heapq.heapify(queue)
    priced: dict[int, Candidate] = {}
    inner = 0
    progress = Progress("solver: pricing plans", len(queue))
    while queue and queue[0][0] <= (1 + SLACK) * best:
        _, fit, i = heapq.heappop(queue)
        c = choices[i]
        summary = layouts.summary(c.tp, c.sequence_parallel)
        line = (1 + SLACK) * best
        if fit:
            problem = stage_problem_of(summary, c, dims, models, memory, recomputable)
            if _unfitted(problem, summary, c, dims, models, line, listed):
                continue
            if i not in priced:
                # Within reach at its floor: priced, to be fitted when its price's bound
                # comes, as a plan priced first would be.
                priced[i] = Candidate(c, predict(summary, mesh, c, dims, models))
                bound = priced[i].predicted.step_time_s * (1 - REBALANCE_GAIN)
                heapq.heappush(queue, (bound, 1, i))
                continue
            inner += 1
            priced[i] = Candidate(
                *_inner(problem, summary, mesh, c, priced[i].predicted, dims, models)
            )
        else:
            progress.update(len(priced))
            # Under context parallelism, the floors without its layout first: it is dear.
            if c.cp > 1 and (
                _price_floors(summary, c, dims, models, floors, line, listed, memory, False) is None
                or step_time_lower_bound(summary, c, dims, models, floors) > line
            ):
                continue
            bounds = _price_floors(summary, c, dims, models, floors, line, listed, memory)
            if bounds is None:
                continue
            if bounds[1] > memory:
                # As `predict` cuts it, it cannot fit: it goes to the inner model's
                # queue as it is, priced only where that fits it.
                heapq.heappush(queue, (bounds[0] * (1 - REBALANCE_GAIN), 1, i))
                continue
            priced[i] = Candidate(c, predict(summary, mesh, c, dims, models))
            if priced[i].predicted.peak_memory_bytes > memory and (c.pp > 1 or recomputable):
                bound = priced[i].predicted.step_time_s * (1 - REBALANCE_GAIN)
                heapq.heappush(queue, (bound, 1, i))
        if priced[i].predicted.peak_memory_bytes <= memory:
            best = min(best, priced[i].predicted.step_time_s)
            listed.add(priced[i])
    out = [priced[i] for i in sorted(priced)]  # in the choices' order
    if hopeless and all(cand.predicted.peak_memory_bytes > memory for cand in out):
        out += [
            Candidate(c, predict(layouts.summary(c.tp, c.sequence_parallel), mesh, c, dims, models))
            for c in hopeless
        ]
    log.info(
        "solver: priced %d of %d plans, %d with the inner model, in %.3fs",
        len(out),
        len(choices),
        inner,
        time.perf_counter() - start,
    )
    return out


class _Listed:
    """The plans that fit priced so far, for whether a slower plan could still be one of
    the alternatives a plan lists (`pins._alternatives`, the fastest of each set of
    mechanisms but the plan's own): not where MAX_ALTERNATIVES + 1 plans faster than it
    differ in their degrees, ZeRO stage, microbatches or schedule, since those
    differ in what they switch on. The plan that runs is one of them or slower, so at
    least MAX_ALTERNATIVES are listed before it."""

    def __init__(self) -> None:
        self.fitting: list[tuple[float, tuple]] = []

    def add(self, candidate: Candidate) -> None:
        c = candidate.choices
        kind = (c.degrees, c.zero, c.microbatches, c.schedule, c.virtual_stages)
        self.fitting.append((candidate.predicted.step_time_s, kind))

    def full_below(self, step_time: float) -> bool:
        """Whether no plan as slow as `step_time` or slower can be listed."""
        kinds = {kind for t, kind in self.fitting if t < step_time}
        return len(kinds) > MAX_ALTERNATIVES


def _unfitted(
    problem: StageProblem,
    summary: GraphSummary,
    c: Choices,
    dims: Mapping[str, int],
    models: CostModels,
    line: float,
    listed: _Listed,
) -> bool:
    """Whether a plan that does not fit is left unfitted: where no cuts the inner model
    could make bring it within `line` (`_fitted_floor`); or where, with the gathers
    ZeRO-3 cannot hide on each rank (`unhidden_gathers`) and the step's own work
    (`once_per_step_floor`), neither within `line` nor among the alternatives."""
    if _fitted_beyond(problem, c, line):
        return True
    segments = rank_segments(summary, {**dims, BATCH: c.microbatch_size}, c)
    unhidden = unhidden_gathers(segments, c, models)
    if unhidden is None:
        return False
    tick = problem.time_unit_s
    extra = [math.floor(seconds / tick) for seconds in unhidden]
    params = sum(s.param_numel(c.tp) for s in segments)
    floor = _fitted_floor(problem, c, extra) + once_per_step_floor(params, c, models)
    return floor > line and listed.full_below(floor)


def _price_floors(
    summary: GraphSummary,
    c: Choices,
    dims: Mapping[str, int],
    models: CostModels,
    floors: dict,
    line: float,
    listed: _Listed,
    memory: int,
    cp_layout: bool = True,
) -> tuple[float, int] | None:
    """Floors of the step time and peak memory `predict` gives a pipeline cut where its
    compute balances ((0, 0) for any other plan, or without `cp_layout`); None where
    they leave it unpriced: where its step less the most the inner model's cuts could
    gain is beyond `line` (it could neither be chosen nor fitted), and it could not be
    among the alternatives, being slower than enough plans that fit or, by its memory's
    floor, not fitting. The floors: with its last rank's bound
    (`step_time_lower_bound`, without the cp layout where not `cp_layout`), then with
    the ranks `predict` cuts (`balanced_pipeline_floors`)."""
    if c.pp == 1 or c.stage_cuts:
        return 0.0, 0
    floor = step_time_lower_bound(summary, c, dims, models, floors, cp_layout, last_rank=True)
    if floor * (1 - REBALANCE_GAIN) > line and listed.full_below(floor):
        return None
    if not cp_layout:
        return 0.0, 0
    step, peak = balanced_pipeline_floors(summary, c, dims, models)
    step = max(step, floor)
    if step * (1 - REBALANCE_GAIN) > line and (peak > memory or listed.full_below(step)):
        return None
    return step, peak


def _states_overflow(
    summary: GraphSummary,
    c: Choices,
    dims: Mapping[str, int],
    models: CostModels,
    memory: int,
    cache: dict,
) -> bool:
    """Whether a rank's parameters, gradients and optimizer state alone exceed the
    device's memory on the rank holding the mean share of the pipeline: what neither
    recomputation nor stage cuts reduce. `cache`: the parameters a rank of each
    tp × ep holds, and the answers, kept across plans (most differ in nothing it reads)."""
    key = (id(summary), c.tp, c.ep)
    answer = (*key, c.pp, c.dp, c.zero, c.offload, c.master_weights)
    if answer not in cache:
        if key not in cache:
            at = {**dims, BATCH: 1}
            cache[key] = sum(s.param_numel(c.tp, c.ep) for s in summary.evaluate(at))
        states = models.memory.breakdown(
            cache[key] / c.pp,
            c.dp,
            c.zero,
            offload=c.offload,
            ep=c.ep,  # every weight sharded as the non-experts are: a floor
            master_weights=c.master_weights,
        )
        cache[answer] = sum(states.values()) > memory
    return cache[answer]


class _StatesFit:
    """Whether a rank's parameters, gradients and optimizer state fit the device
    (`_states_overflow`), by degrees, ZeRO stage and sequence parallelism: asked before
    a plan with context parallelism is made, as a large mesh has tens of thousands of
    them, most of whose states overflow, which `_price` would leave unpriced."""

    def __init__(
        self, layouts: TpLayouts, mesh: Mesh, pins: Pins, dims: Mapping[str, int], offload: bool
    ) -> None:
        self.layouts, self.pins, self.dims, self.offload = layouts, pins, dims, offload
        self.memory = mesh.device.memory_bytes
        self.models = CostModels.of(mesh, pins.precision, pins.compile)
        self.held: dict = {}  # _states_overflow's
        self.answers: dict[tuple[Degrees, int, bool], bool] = {}

    def __call__(self, degrees: Degrees, zero: int, sp: bool) -> bool:
        if (degrees, zero, sp) not in self.answers:
            # What `_states_overflow` reads of a plan: its degrees, ZeRO stage and where
            # its optimizer state and master weights live.
            schedule = Schedule.ONE_F_ONE_B.value if degrees[Axis.PP] > 1 else None
            probe = Choices(
                1,
                degrees,
                zero,
                schedule=schedule,
                precision=self.pins.precision,
                offload=self.offload,
                master_weights=self.pins.master_weights,
            )
            summary = self.layouts.summary(degrees[Axis.TP], sp)
            overflows = _states_overflow(
                summary, probe, self.dims, self.models, self.memory, self.held
            )
            self.answers[degrees, zero, sp] = not overflows
        return self.answers[degrees, zero, sp]


def _with_inner_cuts(
    layouts: TpLayouts, mesh: Mesh, chosen: Candidate, dims: Mapping[str, int]
) -> Candidate:
    """The chosen pipeline with the inner model's cuts (it was priced with cuts
    balanced by compute), where they fit."""
    c = chosen.choices
    models = CostModels.of(mesh, c.precision, c.compiled)
    summary = layouts.summary(c.tp, c.sequence_parallel)
    problem = stage_problem_of(summary, c, dims, models, mesh.device.memory_bytes, False)
    choices, predicted = _inner(problem, summary, mesh, c, chosen.predicted, dims, models)
    if predicted.step_time_s > chosen.predicted.step_time_s:
        return chosen
    return replace(chosen, choices=choices, predicted=predicted)


def _fitted_floor(problem: StageProblem, c: Choices, extra: Sequence[int] = ()) -> float:
    """A step time the inner model cannot beat on `problem`: the pipeline's microbatches
    and bubble at the least pace any stage cuts and recomputation could reach
    (`stage_model.pace_lower_bound`, with `extra` time on each unit), less a margin
    for the rounding of its units."""
    return _step_at_pace(problem, c, pace_lower_bound(problem, extra))


def _fitted_beyond(problem: StageProblem, c: Choices, line: float) -> bool:
    """Whether `_fitted_floor(problem, c)` is beyond `line`: whether the least pace is
    beyond the most whose step is within it (`stage_model.pace_within`, one test of
    what the floor bisects)."""
    per_unit = _step_at_pace(problem, c, 1.0)
    if line == math.inf or per_unit <= 0:
        return False
    most = math.floor(line / per_unit)
    while most > 0 and _step_at_pace(problem, c, most) > line:
        most -= 1
    while _step_at_pace(problem, c, most + 1) <= line:
        most += 1
    return not pace_within(problem, most)


def _step_at_pace(problem: StageProblem, c: Choices, pace: float) -> float:
    """`_fitted_floor` at a pace of `pace` time units."""
    seconds = pace * problem.time_unit_s * (1 - 1e-4)
    bubble = bubble_fraction(c.schedule, c.pp, c.microbatches, c.virtual_stages)
    return c.microbatches * (1 + bubble) * seconds


def _inner(
    problem: StageProblem,
    summary: GraphSummary,
    mesh: Mesh,
    c: Choices,
    predicted: Predicted,
    dims: Mapping[str, int],
    models: CostModels,
) -> tuple[Choices, Predicted]:
    """`c` with the stage cuts and recomputed blocks of the inner CP-SAT
    (`stage_model.solve_stages`) over `problem`, priced. Where nothing fits, the plan
    that recomputes every block stands for `c`, so that a refusal can say how close it
    came."""
    memory = mesh.device.memory_bytes
    solved = solve_stages(problem)
    if solved is None:
        every = tuple(u.key for u in problem.units if u.kind is not None)
        if not every:
            return c, predicted
        c = replace(c, recompute=c.recompute + every)
        return c, predict(summary, mesh, c, dims, models)
    units = problem.units
    chosen = replace(
        c,
        stage_cuts=tuple(units[i].key for i in solved.starts),
        recompute=c.recompute + tuple(units[i].key for i in sorted(solved.recomputed)),
        recompute_attention=c.recompute_attention
        + tuple(units[i].key for i in sorted(solved.attention)),
    )
    priced = predict(summary, mesh, chosen, dims, models)
    if priced.peak_memory_bytes <= memory or predicted.peak_memory_bytes > memory:
        return chosen, priced
    return c, predicted


def _solve(candidates: list[Candidate], memory: int) -> Candidate:
    start = time.perf_counter()
    model = cp_model.CpModel()
    x = [model.new_bool_var(f"x{i}") for i in range(len(candidates))]
    times = [max(1, round(c.predicted.step_time_s * 1e6)) for c in candidates]
    add_one_plan(model, x)
    add_memory(model, x, [c.predicted.peak_memory_bytes for c in candidates], memory)
    model.minimize(sum(t * v for t, v in zip(times, x)))
    fastest = _run(model, x, candidates, memory)
    add_near_fastest(model, x, times, times[candidates.index(fastest)])
    # The simplest; among equally simple plans the fastest, whatever the candidates' order.
    order = sorted(range(len(candidates)), key=lambda i: (times[i], i))
    rank = {i: r for r, i in enumerate(order)}
    n = len(candidates)
    model.minimize(
        sum((c.simplicity * n + rank[i]) * v for i, (c, v) in enumerate(zip(candidates, x)))
    )
    chosen = _run(model, x, candidates, memory)
    log.debug(
        "solver: %d candidate plans, %.3fs; chose %s",
        len(candidates),
        time.perf_counter() - start,
        chosen.choices,
    )
    return chosen


def add_one_plan(model: cp_model.CpModel, x: list) -> None:
    model.add_exactly_one(x)


def add_memory(model: cp_model.CpModel, x: list, peaks: list[int], memory: int) -> None:
    # Candidates that cannot fit are fixed off; the sum form keeps the model general.
    model.add(sum(min(p, memory + 1) * v for p, v in zip(peaks, x)) <= memory)


def add_near_fastest(model: cp_model.CpModel, x: list, times: list[int], best: int) -> None:
    model.add(sum(t * v for t, v in zip(times, x)) <= int(best * (1 + SLACK)))


def _run(model: cp_model.CpModel, x: list, candidates: list[Candidate], memory: int):
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = SEED
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise NoPlanFits(_no_fit_message(candidates, memory))
    return next(c for c, v in zip(candidates, x) if solver.value(v))


def _no_fit_message(candidates: list[Candidate], memory: int) -> str:
    return (
        f"no plan fits the device's {format_bytes(memory)}: the smallest the pins allow "
        f"{_shortfall(candidates, memory)}. Unpin axes, use more devices, or a smaller batch"
    )


def _host_masters_hint(
    layouts: TpLayouts,
    mesh: Mesh,
    pins: Pins,
    batch: int,
    dims: Mapping[str, int],
    blocks: tuple[str, ...],
) -> str:
    """Where nothing fits even offloaded, whether the fp32 master weights on the host
    would make a plan fit: the user's choice only (it changes the math), so it is
    advice, never chosen."""
    if pins.precision not in LOW_DTYPES or pins.master_weights == MasterWeights.HOST:
        return ""
    host = replace(pins, master_weights=MasterWeights.HOST.value)
    recomputable = pins.recompute is None and pins.recompute_attention is None
    choices = list(_choices(layouts, mesh, host, batch, blocks, offload=True))
    memory = mesh.device.memory_bytes
    fitting = [
        c
        for c in _price(layouts, mesh, dims, choices, recomputable)
        if c.predicted.peak_memory_bytes <= memory
    ]
    if not fitting:
        return ""
    smallest = min(fitting, key=lambda c: c.predicted.peak_memory_bytes).predicted
    return (
        ". With the fp32 master weights on the host too (master_weights='host', 16-bit "
        "weights and gradients on the device; it changes the math slightly) a plan fits, "
        f"in {format_bytes(smallest.peak_memory_bytes)} per rank"
    )


def _shortfall(candidates: list[Candidate], memory: int) -> str:
    """The candidate needing the least memory, and what it needs beyond `memory`."""
    smallest = min(candidates, key=lambda c: c.predicted.peak_memory_bytes)
    need = smallest.predicted.peak_memory_bytes
    c = smallest.choices
    return (
        f"({c.degrees} zero={c.zero} microbatches={c.microbatches}"
        f"{' with recomputation' if c.recompute else ''}) needs {format_bytes(need)} per "
        f"rank, {format_bytes(need - memory)} too much"
    )


def _choices(
    layouts: TpLayouts,
    mesh: Mesh,
    pins: Pins,
    batch: int,
    blocks: tuple[str, ...],
    offload: bool = False,
    fit: _StatesFit | None = None,
) -> Iterator[Choices]:
    """Every combination the pins allow; with `offload`, only those that can keep the
    optimizer state on the host (`policy.offload_refusal`); with `fit`, only the plans
    with context parallelism whose states fit (the search prices none of the others).
    A tp whose layout shards nothing is one too: its ranks each run the whole step,
    with no collective between them, which on a small model can beat splitting the
    batch (`docs/tensor-parallel.md`)."""
    sequence, experts = layouts.ring_sequence(), layouts.experts
    for degrees in Degrees.factorizations(mesh.world_size, pins.degrees):
        if not _admissible(degrees, mesh, pins, batch, len(blocks), sequence, experts):
            continue
        tp, pp, dp = degrees[Axis.TP], degrees[Axis.PP], degrees[Axis.DP]
        ep = degrees[Axis.EP]
        sp = layouts.sequence_parallel(tp, pins.sequence_parallel)
        if ep > 1 and tp > 1 and not layouts.splits_experts(tp, sp):
            continue  # the layout gathers an expert weight: ep cannot cut its experts
        cp = degrees[Axis.CP]
        for schedule, virtual, m in _pipelines(pp, batch // (dp * ep), pins, len(blocks)):
            if cp > 1 and pins.degree(Axis.CP) is None and (batch // (dp * m)) % cp == 0:
                # Each of the cp ranks could take whole sequences of the microbatch
                # instead: the plan with dp·cp replicas does the same tokens per rank
                # in the same memory, without the ring, the gradient all-reduces per
                # microbatch and the logits' gather. cp pays only below a sequence.
                continue
            # Under ep, ZeRO shards over dp x ep (the experts' part over dp).
            for zero in _zero_stages(dp * ep, pins):
                if offload and offload_refusal(zero, dp, cp, ep):
                    continue
                if cp > 1 and fit is not None and not fit(degrees, zero, sp):
                    continue
                if _refused_precision(pins, dp * ep, cp, zero, offload):
                    continue
                for recompute in _recompute_sets(blocks, pins):
                    yield Choices(
                        batch,
                        degrees,
                        zero,
                        m,
                        schedule,
                        virtual,
                        pins.precision,
                        recompute,
                        _pinned_paths(pins.recompute_attention, blocks),
                        sequence_parallel=sp,
                        offload=offload,
                        master_weights=pins.master_weights,
                        sync_every=pins.sync_every,
                        per_part_statistics=pins.per_part_statistics,
                        reduce_dtype=pins.reduce_dtype,
                        compiled=pins.compile,
                        batch_product_loss=pins.batch_product_loss,
                    )


def _refused_precision(pins: Pins, dp: int, cp: int, zero: int, offload: bool) -> bool:
    """Whether 16-bit parameters cannot run this combination (`param_dtype_refusal`)."""
    local_sgd, compressed = pins.sync_every is not None, pins.grad_compression is not None
    return bool(
        param_dtype_refusal(
            pins.precision, pins.reduce_dtype, dp, cp, zero, offload, local_sgd, compressed
        )
    )


def _admissible(
    degrees: Degrees,
    mesh: Mesh,
    pins: Pins,
    batch: int,
    blocks: int,
    sequence: int | None,
    experts: int | None = None,
) -> bool:
    """What each axis's degree must respect; a pinned degree passes where the rule is a
    preference (`solver.pipeline` and the passes explain what cannot run). An axis with
    no rule here is admissible at every degree. `sequence`: the sequence length context
    parallelism would split (`TpLayouts.ring_sequence`), None where it would not;
    `experts`: the experts per routed layer expert parallelism would split."""

    def free(axis: Axis) -> bool:
        return pins.degree(axis) is None

    tp, pp, cp, ep = (degrees[a] for a in (Axis.TP, Axis.PP, Axis.CP, Axis.EP))
    return not (
        # the sequence's 2·cp chunks, whole tokens each
        (free(Axis.CP) and cp > 1 and (not sequence or sequence % (2 * cp)))
        # equal runs of every layer's experts; not with cp
        or (ep > 1 and (not experts or experts % ep or cp > 1))
        or batch % degrees.batch_split  # each rank of dp × ep takes an equal share
        # tensor parallelism on a node's links: consecutive ranks, so a group that does
        # not divide the node straddles two and runs at the network's pace
        or (free(Axis.TP) and mesh.per_node % tp)
        or (pins.sequence_parallel and tp == 1)
        or (free(Axis.PP) and pp > max(1, blocks))  # a stage holds a block at least
    )


def _pipelines(pp: int, replica_batch: int, pins: Pins, blocks: int):
    """(schedule, virtual stages, microbatches) to try. Pinned values pass through as
    they are: `solver.pipeline` explains what a schedule cannot run."""
    if pp == 1:
        for m in [pins.microbatches] if pins.microbatches else _microbatch_counts(replica_batch):
            yield pins.schedule, 1, m
        return
    if pins.schedule:
        schedules = [pins.schedule]
    elif pins.microbatches == 1:  # one microbatch: GPipe runs it, 1F1B needs pp of them
        schedules = [Schedule.GPIPE.value]
    elif (pins.virtual_stages or 1) > 1:
        schedules = [Schedule.INTERLEAVED_1F1B.value]
    else:
        schedules = [Schedule.ONE_F_ONE_B.value, Schedule.INTERLEAVED_1F1B.value]
    for schedule in schedules:
        for virtual in _virtual_counts(schedule, pp, blocks, pins.virtual_stages):
            if pins.microbatches:
                yield schedule, virtual, pins.microbatches
                continue
            for m in _microbatch_counts(replica_batch, pp):
                if not microbatches_problem(schedule, pp, m):
                    yield schedule, virtual, m


def _virtual_counts(schedule: str | None, pp: int, blocks: int, pinned: int | None) -> list[int]:
    """Virtual stages per rank to try: the pinned count; 1 but for interleaved 1F1B; else
    every count from 2 whose pp·v chunks hold a block each, up to MAX_VIRTUAL_STAGES. More
    chunks shrink the bubble, (p-1)/(v·m) of the step, but each microbatch crosses v·p-1
    stage boundaries instead of p-1 and the first stage holds more in flight: the cost
    models weigh the two."""
    if pinned:
        return [pinned]
    if schedule != Schedule.INTERLEAVED_1F1B:
        return [1]
    return list(range(2, min(MAX_VIRTUAL_STAGES, blocks // pp) + 1))


def _microbatch_counts(replica_batch: int, pp: int = 1) -> list[int]:
    """Microbatch counts that divide the replica's batch: pp, 2pp and 4pp (1 without a
    pipeline), then every count giving a power-of-two microbatch size (1, 2, 4, ...
    samples): gradient accumulation without a pipeline, and the many small microbatches
    a deep pipeline needs to keep its bubble small. The first ones are priced first, so
    the search's pruning has a good plan to beat early."""
    first = [m for m in ((pp, 2 * pp, 4 * pp) if pp > 1 else (1,)) if replica_batch % m == 0]
    sizes = [2**k for k in range(replica_batch.bit_length()) if replica_batch % 2**k == 0]
    rest = sorted({replica_batch // s for s in sizes} - set(first))
    return first + rest


def _zero_stages(dp: int, pins: Pins) -> list[int]:
    if pins.zero is not None:
        return [pins.zero]
    if dp == 1:
        return [0]
    # ZeRO-3 would change the updates of an optimizer that is not elementwise.
    return [z for z in (0, 1, 2, 3) if not zero_refusal(z, pins.optimizer_class)]


def _pinned_paths(pin: tuple[str, ...] | bool | None, blocks: tuple[str, ...]) -> tuple[str, ...]:
    """A recomputation pin's module paths: True for every block, None or False for none."""
    if pin is True:
        return blocks
    return tuple(pin) if pin else ()


def _recompute_sets(blocks: tuple[str, ...], pins: Pins) -> list[tuple[str, ...]]:
    """Pinned recomputation; unpinned, none here: `_inner` recomputes the blocks that
    memory calls for."""
    if pins.recompute is True:
        return [blocks]
    if pins.recompute is None or pins.recompute is False:
        return [()]
    return [tuple(pins.recompute)]
