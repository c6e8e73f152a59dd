"""Pipeline chunks: at the plan's cuts, or balanced where blocks begin."""

from __future__ import annotations

import itertools
import random

import pytest

from autopart.cost_models.choices import Choices
from autopart.cost_models.stages import (
    _linear_partition,
    _partitions,
    balanced_chunks,
    chunks_at_cuts,
)
from autopart.cost_models.summary import Segment, SegmentWork
from autopart.degrees import Degrees


def _segments(keys):
    blocks = {k: "layers#0" if k.startswith("layers.") else None for k in keys}
    return [SegmentWork(Segment(k, blocks[k], (), (), (), 0, 0, 0), (), 0) for k in keys]


KEYS = ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "head"]


def test_balanced_chunks_cut_where_blocks_begin():
    segments = _segments(KEYS)
    costs = [1, 10, 10, 10, 10, 1, 5]
    assert balanced_chunks(segments, costs, 2) == [0, 0, 0, 1, 1, 1, 1]
    assert balanced_chunks(segments, costs, 4) == [0, 0, 1, 2, 3, 3, 3]


def test_balanced_chunks_need_enough_segments():
    with pytest.raises(ValueError, match="need at least"):
        balanced_chunks(_segments(["a", "b"]), [1, 1], 3)


def test_chunks_at_cuts():
    segments = _segments(KEYS)
    assert chunks_at_cuts(segments, ["layers.2"]) == [0, 0, 0, 1, 1, 1, 1]
    assert chunks_at_cuts(segments, ["layers.1", "head"]) == [0, 0, 1, 1, 1, 1, 2]
    with pytest.raises(ValueError, match="names no module"):
        chunks_at_cuts(segments, ["head", "layers.1"])


def test_a_pipeline_needs_a_schedule():
    with pytest.raises(ValueError, match="needs a schedule"):
        Choices(global_batch=8, degrees=Degrees(pp=2))


def _least_largest_part(costs, parts):
    """Brute force: the least largest sum over every way to cut `costs` into `parts`."""
    n = len(costs)
    return min(
        max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, n)))
        for cuts in itertools.combinations(range(1, n), parts - 1)
    )


def test_a_partition_is_optimal_whatever_was_cut_before():
    """One table serves every number of parts of the same costs: each is as the brute
    force finds, and the same whether fewer or more parts were asked for first."""
    rng = random.Random(0)
    for _ in range(200):
        costs = tuple(
            rng.choice([0.0, 1.0, 2.0, rng.random() * 5]) for _ in range(rng.randint(1, 9))
        )
        counts = list(range(1, len(costs) + 1))
        rng.shuffle(counts)
        for parts in counts:
            chunk = _linear_partition(costs, parts)
            assert sorted(set(chunk)) == list(range(parts)) and list(chunk) == sorted(chunk)
            largest = max(sum(c for c, k in zip(costs, chunk) if k == j) for j in range(parts))
            assert largest == pytest.approx(_least_largest_part(costs, parts))
            _partitions.cache_clear()
            assert _linear_partition(costs, parts) == chunk  # made on a fresh table
