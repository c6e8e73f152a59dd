"""The inner level: pipeline stage cuts and recomputation, one CP-SAT model per outer
candidate (degrees, ZeRO stage, schedule, microbatches).

Over the units of `cost_models.stage_costs.StageProblem` (the graph's segments, in
order), with K chunks on p pipeline ranks (chunk k on rank k mod p):

    s_k ∈ cut positions, s_1 < s_2 < … < s_{K−1}     where chunk k begins (s_0 = 0, s_K = n)
    X[s_k]  via element constraints                   prefix sums of every unit figure X,
                                                      so chunk k's X is X[s_{k+1}] − X[s_k]
    f_kj ∈ 0 … blocks of kind j in chunk k            how many of them are recomputed
    a_kj ∈ 0 … blocks of kind j in chunk k − f_kj     how many recompute their attention
                                                      core alone (selective)

Copies of one block (one kind j) cost the same, so which of a chunk's copies are
recomputed does not matter, only how many: the model has K·(2J + 4) variables
whatever the depth, and a repeated block's costs are computed once. Then per rank r:

    pace ≥ Σ_{k on r} (time_k + Σ_j f_kj · recompute_time_j + a_kj · attention_time_j)
           + comm_r
    (1 + a) · [ states_r + in_flight_r · (kept_r − Σ f_kj · freed_j − Σ a_kj · core_j)
                + largest_r + bucket_r + fixed_r ] ≤ memory
    largest_r ≥ saved_j · g_rj,  f_kj ≤ n_j · g_rj    (the block recomputed in backward)
    largest_r ≥ core_j · h_rj,   a_kj ≤ n_j · h_rj    (the core recomputed in backward)
    bucket_r = min(bucket cap, gradient bytes_r)

Objectives, lexicographic: the least pace (the pipeline runs at its slowest rank's),
then the least recomputation added over all ranks. Both are integers (ns, bytes), the
same numbers `stage_costs.evaluate` adds up, so `tests/solver/test_stage_model.py` can
compare the choice with a brute-force enumeration. One worker, a fixed seed:
deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from fractions import Fraction
from itertools import accumulate

from ortools.sat.python import cp_model

from autopart.cost_models.stage_costs import StageAssignment, StageProblem, Unit, evaluate

SEED = 0
# Work units (deterministic, unlike seconds) a solve may take before it answers with its
# best assignment so far: the small graphs of the tests solve to optimality well within
# it; a deep pipeline at scale may stop short of the proof.
DETERMINISTIC_LIMIT = 1.0


def solve_stages(problem: StageProblem) -> StageAssignment | None:
    """The best assignment of `problem`, or None when none fits its memory (or it has
    fewer cut positions than chunks need)."""
    run = _uniform_run(problem)
    if len(problem.cut_positions) < problem.chunks - 1 or not _may_fit(problem, run):
        return None
    built = _Model(problem, run)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = SEED
    solver.parameters.max_deterministic_time = DETERMINISTIC_LIMIT
    if solver.solve(built.model) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    built.model.add(built.pace <= solver.value(built.pace))
    built.model.minimize(built.added)
    if solver.solve(built.model) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None  # cannot happen: the first solution satisfies the added bound
    recomputed, attention = built.recomputed(solver)
    return evaluate(problem, built.starts(solver), recomputed, attention)


class _Model:
    def __init__(self, problem: StageProblem, run: tuple[int, int] | None) -> None:
        """`run`: the units that are copies of one block (`_uniform_run`), if any."""
        self.problem = p = problem
        self.model = m = cp_model.CpModel()
        chunks = p.chunks
        self.kinds = p.kinds
        self.run = run
        if self.run is not None:
            time, states, grads, saved, count = self._counted(*self.run)
        else:
            time, states, grads, saved, count = self._cut()
        first = {j: next(u for u in p.units if u.kind == j) for j in self.kinds}
        total = {j: sum(u.kind == j for u in p.units) for j in self.kinds}
        # Recomputation is counted per group of chunks: per chunk in general, per rank
        # where every block is alike (only a rank's total matters then).
        ranks = [tuple(range(r, chunks, p.pp)) for r in range(p.pp)]
        self.groups = ranks if self.run is not None else [(k,) for k in range(chunks)]
        self.f = {
            (g, j): m.new_int_var(0, total[j], f"f{g}[{j}]")
            for g in range(len(self.groups))
            for j in self.kinds
        }
        cores = [j for j in self.kinds if first[j].has_attention_core]
        self.a = {
            (g, j): m.new_int_var(0, total[j], f"a{g}[{j}]")
            for g in range(len(self.groups))
            for j in cores
        }
        for (g, j), f in self.f.items():
            m.add(f + self.a.get((g, j), 0) <= sum(count[j][k] for k in self.groups[g]))

        self.pace = m.new_int_var(
            0,
            sum(u.time + max(u.recompute_time, u.attention_time) for u in p.units)
            + max(p.comm, default=0),
            "pace",
        )
        added = []
        for r, mine in enumerate(ranks):
            groups = self._groups_of(mine)
            extra = [self.f[g, j] * first[j].recompute_time for g in groups for j in self.kinds]
            extra += [self.a[g, j] * first[j].attention_time for g, j in self.a if g in groups]
            added += extra
            m.add(self.pace >= sum(time[k] for k in mine) + sum(extra) + p.comm[r])
            self._memory(r, mine, states, grads, saved, first, total)
        self.added = sum(added)
        m.minimize(self.pace)

    def _groups_of(self, chunks: tuple[int, ...]) -> list[int]:
        return [g for g, group in enumerate(self.groups) if group[0] in chunks]

    def _counted(self, a: int, b: int) -> tuple[list, list, list, list, dict]:
        """Blocks a .. b−1 are copies of one block and the only cut positions: chunk k
        holds n_k ≥ 1 of them (Σ n_k = b − a), the units before them go with chunk 0 and
        those after with the last; no element constraints."""
        p, m = self.problem, self.model
        block = p.units[a]
        self.n = [m.new_int_var(1, b - a, f"n{k}") for k in range(p.chunks)]
        m.add(sum(self.n) == b - a)
        # Two chunks of one rank, neither the first nor the last, can trade blocks
        # without changing any rank's totals: keep the larger first.
        for k in range(1, p.chunks - 1 - p.pp):
            m.add(self.n[k] >= self.n[k + p.pp])

        def figure(attr: str) -> list:
            before = sum(getattr(u, attr) for u in p.units[:a])
            after = sum(getattr(u, attr) for u in p.units[b:])
            per_block = getattr(block, attr)
            return [
                n * per_block + (before if k == 0 else 0) + (after if k == p.chunks - 1 else 0)
                for k, n in enumerate(self.n)
            ]

        count = {j: list(self.n) for j in self.kinds}  # at most the block's own kind
        return figure("time"), figure("states"), figure("grads"), figure("saved"), count

    def _cut(self) -> tuple[list, list, list, list, dict]:
        """Any units: chunk k begins at s_k, and each figure of a chunk is the
        difference of its prefix sums at s_k and s_{k+1} (element constraints)."""
        p, m = self.problem, self.model
        self.s = [
            m.new_int_var_from_domain(cp_model.Domain.from_values(p.cut_positions), f"s{k}")
            for k in range(1, p.chunks)
        ]
        for a, b in zip(self.s, self.s[1:]):
            m.add(a < b)

        def chunk_sums(values: list[int], name: str) -> list:
            prefix = [0, *accumulate(values)]
            at: list[cp_model.LinearExpr | int] = [0]
            for k, s in enumerate(self.s):
                v = m.new_int_var(0, prefix[-1], f"{name}{k + 1}")
                m.add_element(s, prefix, v)
                at.append(v)
            at.append(prefix[-1])
            return [at[k + 1] - at[k] for k in range(p.chunks)]

        count = {j: chunk_sums([int(u.kind == j) for u in p.units], f"n[{j}]") for j in self.kinds}
        return (
            chunk_sums([u.time for u in p.units], "time"),
            chunk_sums([u.states for u in p.units], "states"),
            chunk_sums([u.grads for u in p.units], "grads"),
            chunk_sums([u.saved for u in p.units], "saved"),
            count,
        )

    def _memory(self, r, mine, states, grads, saved, first, total) -> None:
        p, m = self.problem, self.model
        scale = 1 + p.allocator
        coefficients = [scale * p.in_flight[r], scale]
        d = math.lcm(*(c.denominator for c in coefficients))
        flight, one = (int(c * d) for c in coefficients)
        groups = self._groups_of(mine)
        freed = sum(
            self.f[g, j] * (first[j].saved - first[j].recompute_keeps)
            for g in groups
            for j in self.kinds
        ) + sum(self.a[g, j] * first[j].attention_frees for g, j in self.a if g in groups)
        largest = m.new_int_var(0, max((u.saved for u in p.units), default=0), f"largest{r}")
        for j in self.kinds:
            g = m.new_bool_var(f"g{r}[{j}]")
            m.add(largest >= first[j].saved * g)
            for group in groups:
                m.add(self.f[group, j] <= total[j] * g)
            if any((group, j) in self.a for group in groups):
                h = m.new_bool_var(f"h{r}[{j}]")
                m.add(largest >= first[j].attention_frees * h)
                for group in groups:
                    m.add(self.a[group, j] <= total[j] * h)
        bucket = m.new_int_var(0, p.bucket, f"bucket{r}")
        m.add_min_equality(bucket, [p.bucket, sum(grads[k] for k in mine)])
        kept = sum(saved[k] for k in mine) - freed
        m.add(
            flight * kept + one * (sum(states[k] for k in mine) + largest + bucket + p.fixed[r])
            <= d * p.memory
        )

    def starts(self, solver: cp_model.CpSolver) -> tuple[int, ...]:
        if self.run is None:
            return tuple(solver.value(s) for s in self.s)
        sizes = [solver.value(n) for n in self.n[:-1]]
        return tuple(self.run[0] + size for size in accumulate(sizes))

    def recomputed(self, solver: cp_model.CpSolver) -> tuple[frozenset[int], frozenset[int]]:
        """The blocks recomputed whole, and those recomputing their attention core
        alone: of kind j in the chunks of group g, the first f_gj, then the next a_gj."""
        bounds = [0, *self.starts(solver), len(self.problem.units)]
        whole: set[int] = set()
        attention: set[int] = set()
        for (g, j), f in self.f.items():
            a = self.a.get((g, j))
            into = [whole] * solver.value(f) + [attention] * (
                solver.value(a) if a is not None else 0
            )
            blocks = [
                i
                for k in self.groups[g]
                for i in range(bounds[k], bounds[k + 1])
                if self.problem.units[i].kind == j
            ]
            for chosen, i in zip(into, blocks):
                chosen.add(i)
        return frozenset(whole), frozenset(attention)


def pace_lower_bound(problem: StageProblem, extra: Sequence[int] = ()) -> float:
    """A pace no assignment of `problem` can beat, in its time units (inf when none
    fits), cheap enough to refuse a candidate before its CP-SAT model is built: 0 but
    where the units between the embedding and the head are copies of one block.
    `extra`: time per unit that a rank spends beyond the problem's, at least, whatever
    it recomputes (ZeRO-3's gathers its forward cannot hide), added to its units'.
    The least pace the relaxation (`_pace_relaxation`) allows, found by bisection."""
    relaxation = _pace_relaxation(problem, extra)
    if relaxation is None:
        return 0.0
    feasible, high = relaxation
    if not feasible(high):
        return math.inf
    low = 0
    while low < high:
        middle = (low + high) // 2
        if feasible(middle):
            high = middle
        else:
            low = middle + 1
    return float(low)


def pace_within(problem: StageProblem, pace: int, extra: Sequence[int] = ()) -> bool:
    """Whether `pace_lower_bound(problem, extra)` is at most `pace`: one test of the
    relaxation where the bound takes a bisection of them."""
    relaxation = _pace_relaxation(problem, extra)
    if relaxation is None:
        return pace >= 0
    feasible, high = relaxation
    return pace >= 0 and feasible(min(pace, high))


def _pace_relaxation(
    problem: StageProblem, extra: Sequence[int]
) -> tuple[Callable[[int], bool], int] | None:
    """Whether the relaxation below admits a pace, and a pace it admits where any is
    (else none fits); None where the problem has no uniform run of blocks.

    A relaxation of the model, rank by rank. At pace P, rank r can hold at most cap_r(P)
    blocks: each costs its time t and brings its states and what it keeps in flight,
    m_r = states + in_flight_r · saved; recomputation frees what the rank's memory
    lacks, at best Δ per block (whole or its attention core, the larger) and at least
    ρ time per byte freed (the cheaper of the two). Units around the run count at their
    least (recomputed where they may be), and the largest recomputed block and the ZeRO
    bucket at 0. The ranks must hold every block, at least one per chunk: P is feasible
    only if Σ_r floor(cap_r(P)) ≥ the blocks and each cap_r ≥ its chunks. The least
    such P is at most the model's optimum; feasibility only grows with P."""
    run = _uniform_run(problem)
    if run is None or len(problem.cut_positions) < problem.chunks - 1:
        return None
    p = problem
    a, b = run
    block = p.units[a]
    last = (p.chunks - 1) % p.pp
    extra = extra or [0] * len(p.units)
    block_time = block.time + min(extra[a:b])
    options = []  # (what recomputing frees, what it costs): whole, or the core alone
    if block.kind is not None:
        options.append((block.saved - block.recompute_keeps, block.recompute_time))
    if block.has_attention_core:
        options.append((block.attention_frees, block.attention_time))
    freeable = max((frees for frees, _ in options), default=0)
    rho = min((time / frees for frees, time in options if frees > 0), default=None)
    scale = float(1 + p.allocator)

    def least_kept(u: Unit) -> int:
        return min(u.saved, u.recompute_keeps) if u.kind is not None else u.saved

    # In floats, for speed: each cap is rounded up by a hair before it is floored, so
    # rounding can only lower the bound.
    ranks = []
    for r in range(p.pp):
        around = list(p.units[:a]) * (r == 0) + list(p.units[b:]) * (r == last)
        flight = float(p.in_flight[r])
        held = sum(u.states + flight * least_kept(u) for u in around)
        room = p.memory / scale - p.fixed[r] - held
        ends = [*range(a)] * (r == 0) + [*range(b, len(p.units))] * (r == last)
        busy = p.comm[r] + sum(u.time for u in around) + sum(extra[i] for i in ends)
        ranks.append((flight, room, busy, block.states + flight * block.saved))

    def cap(pace: int, flight: float, room: float, busy: int, each: float) -> float:
        spare = pace - busy
        if spare < 0 or room < 0:
            return -1.0
        by_room = room / each if each else math.inf
        plain = min(by_room, spare / block_time) if block_time else by_room
        if rho is None or not flight or plain < by_room:  # nothing to free, or time binds
            return plain
        # Beyond room / each blocks, the excess is freed at ρ time per byte, Δ per block.
        rate = rho / flight
        by_time = (spare + room * rate) / (block_time + each * rate)
        shrunk = each - flight * freeable
        return max(plain, min(by_time, room / shrunk)) if shrunk > 0 else by_time

    blocks, least = b - a, p.chunks // p.pp

    def feasible(pace: int) -> bool:
        caps = [cap(pace, *rank) for rank in ranks]
        if min(caps) < least - 1e-9:
            return False
        return sum(math.floor(c + 1e-9) if c < math.inf else blocks for c in caps) >= blocks

    high = sum(u.time + max(u.recompute_time, u.attention_time) for u in p.units) + max(p.comm)
    high += sum(max(0, e) for e in extra)
    return feasible, high


def _uniform_run(problem: StageProblem) -> tuple[int, int] | None:
    """(a, b) when units a .. b−1 are copies of one block (equal in every figure) and
    the cut positions are exactly a + 1 .. b − 1: a transformer's layers between its
    embedding and its head."""
    cuts = problem.cut_positions
    if not cuts:
        return None
    a, b = cuts[0] - 1, cuts[-1] + 1
    if list(cuts) != list(range(a + 1, b)):
        return None
    first = problem.units[a]
    return (a, b) if all(u == first for u in problem.units[a + 1 : b]) else None


def _may_fit(problem: StageProblem, run: tuple[int, int] | None) -> bool:
    """False when no assignment can fit (a necessary condition, cheap, to refuse the
    many hopeless candidates before building a model). However the chunks are cut, one
    of the p ranks holds at least 1/p of the parameters. Where the blocks are alike,
    rank r can hold at most cap_r of them, each bringing at least its model states and
    what it keeps per microbatch in flight, recomputed: the ranks must hold every block,
    and each at least one per chunk."""
    p = problem
    scale = 1 + p.allocator
    if scale * (Fraction(sum(u.states for u in p.units), p.pp) + min(p.fixed)) > p.memory:
        return False
    if run is None:
        return True
    a, b = run
    block = p.units[a]
    keeps = block.recompute_keeps if block.kind is not None else block.saved
    last = (p.chunks - 1) % p.pp
    caps = []
    for r in range(p.pp):
        around = list(p.units[:a]) * (r == 0) + list(p.units[b:]) * (r == last)
        room = (
            p.memory / scale - p.fixed[r] - sum(u.states + p.in_flight[r] * u.saved for u in around)
        )
        each = block.states + p.in_flight[r] * keeps
        caps.append(room // each if each else b - a)
    return min(caps) >= p.chunks // p.pp and sum(caps) >= b - a
