"""Pipeline chunks: at the plan's cuts, or balanced where blocks begin."""

from __future__ import annotations

import pytest

from autopart.cost_models.choices import Choices
from autopart.cost_models.stages import balanced_chunks, chunks_at_cuts
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
