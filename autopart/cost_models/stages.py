"""Which pipeline chunk each segment of the graph runs in.

A plan names its stage cuts by module path (`Plan.stage_cuts`: where chunks 1, 2, ...
begin). Without cuts the graph is split where blocks begin, into contiguous chunks of
as equal cost as the block granularity allows (the linear-partition dynamic programme:
minimize the most expensive chunk). With v virtual stages there are p·v chunks, and
chunk c runs on pipeline rank c mod p (Megatron-LM's interleaving).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from autopart.cost_models.summary import SegmentWork


def chunks_at_cuts(segments: Sequence[SegmentWork], cuts: Sequence[str]) -> list[int]:
    """The chunk of each segment: chunk i + 1 begins at the first segment (after the
    previous cut) whose key is `cuts[i]` or lies inside it."""
    chunk, out = 0, []
    for seg in segments:
        if chunk < len(cuts) and _inside(seg.key, cuts[chunk]):
            chunk += 1
        out.append(chunk)
    if chunk != len(cuts):
        raise ValueError(
            f"stage cut {cuts[chunk]!r} names no module after {cuts[chunk - 1]!r}"
            if chunk
            else f"stage cut {cuts[0]!r} names no module of the graph"
        )
    return out


def balanced_chunks(
    segments: Sequence[SegmentWork], costs: Sequence[float], chunks: int
) -> list[int]:
    """The chunk of each segment, cutting only where blocks begin (anywhere if there are
    too few blocks), so that the most expensive chunk is as cheap as possible."""
    starts = [i for i, s in enumerate(segments) if s.is_block]
    if len(starts) < chunks:
        starts = list(range(len(segments)))
    if len(starts) < chunks:
        raise ValueError(f"{chunks} pipeline chunks need at least {chunks} segments of the graph")
    bounds = [0, *starts[1:], len(segments)]  # units: [bounds[u], bounds[u + 1])
    unit_costs = [sum(costs[bounds[u] : bounds[u + 1]]) for u in range(len(bounds) - 1)]
    unit_chunk = _linear_partition(tuple(unit_costs), chunks)
    return [unit_chunk[u] for u in range(len(unit_costs)) for _ in range(bounds[u], bounds[u + 1])]


def _linear_partition(costs: tuple[float, ...], parts: int) -> tuple[int, ...]:
    """Contiguous non-empty parts of `costs` minimizing the largest sum: each item's part."""
    return _partitions(costs).assignment(parts)


class _Partitions:
    """The linear-partition dynamic programme of one list of costs, for every number of
    parts asked: best[j][i] is the best largest sum for the first i items in j parts,
    the last part starting at cut[j][i], the first start that achieves it. With finite
    costs ≥ 0, best[j − 1][t] never falls and the last part's sum never rises as t
    grows: the best start is where they cross, found walking forward, since the
    crossing never moves back as i grows. Row j is made for every i ≥ j, whatever the
    parts asked, so one table serves them all (a row depends only on the one before):
    the search cuts the same costs into many numbers of parts, one per pipeline depth."""

    def __init__(self, costs: tuple[float, ...]) -> None:
        self.n = len(costs)
        self.prefix = [0.0]
        for c in costs:
            self.prefix.append(self.prefix[-1] + c)
        inf = float("inf")
        self.best = [[0.0] + [inf] * self.n]
        self.cut = [[0] * (self.n + 1)]
        self._assignments: dict[int, tuple[int, ...]] = {}

    def assignment(self, parts: int) -> tuple[int, ...]:
        if parts not in self._assignments:
            while len(self.best) <= parts:
                self._add_row()
            assignment, i = [0] * self.n, self.n
            for j in range(parts, 0, -1):
                t = self.cut[j][i]
                assignment[t:i] = [j - 1] * (i - t)
                i = t
            self._assignments[parts] = tuple(assignment)
        return self._assignments[parts]

    def _add_row(self) -> None:
        j, prefix = len(self.best), self.prefix
        before, lo = self.best[j - 1], j - 1
        row, cuts = [float("inf")] * (self.n + 1), [0] * (self.n + 1)
        c = lo  # the first t where before[t] ≥ prefix[i] − prefix[t]: never falls as i grows
        for i in range(j, self.n + 1):
            end = prefix[i]
            while c < i and before[c] < end - prefix[c]:
                c += 1
            # The best start is c, or before it where the last part is smaller.
            if c == lo or (c < i and before[c] < end - prefix[c - 1]):
                t = c
            else:
                t = _first_smallest_last(prefix, lo, c - 1, end)
            row[i], cuts[i] = max(before[t], end - prefix[t]), t
        self.best.append(row)
        self.cut.append(cuts)


@functools.lru_cache(maxsize=256)  # the search partitions the same costs many times
def _partitions(costs: tuple[float, ...]) -> _Partitions:
    return _Partitions(costs)


def _first_smallest_last(prefix: list[float], lo: int, c: int, end: float) -> int:
    """The first t in [lo, c] whose last part, end − prefix[t], is as small as c's:
    items of zero cost leave it flat."""
    left = end - prefix[c]
    a, b = lo, c
    while a < b:
        m = (a + b) // 2
        if end - prefix[m] <= left:
            b = m
        else:
            a = m + 1
    return a


def _inside(key: str, path: str) -> bool:
    return key == path or key.startswith(path + ".")
