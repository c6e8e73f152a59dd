"""What ring attention's unfused pairs of chunks add to its fused arithmetic."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autopart.cost_models.compute import ComputeModel
from autopart.cost_models.context import (
    RING_PAIR_OPERATORS,
    RING_PAIR_SCORE_PASSES,
    SCORE_BYTES,
    ring_pairs_time,
)
from autopart.cost_models.work import ATTENTION, NodeWork
from autopart.mesh import PRESETS


def _attention(batch_heads: float, length: float, head: float, causal: bool) -> NodeWork:
    out = batch_heads * length * head * 4  # fp32, as captured
    return NodeWork(
        ATTENTION,
        4 * batch_heads * length * length * head,
        written_bytes=out,
        shape=(length, length, head),
        causal=causal,
    )


@pytest.mark.parametrize(("causal", "pairs"), [(True, 2 * 4 + 1), (False, 4 * 4)])
def test_a_rank_runs_its_pairs_operators_one_by_one(causal, pairs):
    # Scores too few to matter: each pair pays its operators' dispatch, cp = 4.
    compute = ComputeModel(replace(PRESETS["cpu"], memory_bandwidth=1e30))
    forward, backward = ring_pairs_time(_attention(1, 8, 8, causal), 4, compute)
    launch = compute.launch * compute.scale
    assert forward == pytest.approx(pairs * RING_PAIR_OPERATORS[0] * launch)
    assert backward == pytest.approx(pairs * RING_PAIR_OPERATORS[1] * launch)


def test_each_pair_passes_over_its_score_block():
    # No dispatch: 2 × 4 heads of 1024 queries over 1024 keys split over cp = 2, causal:
    # 5 pairs of 256 × 256 scores, against one device's 1024 × 1024 on 1/cp of the batch.
    compute = ComputeModel(replace(PRESETS["cpu"], kernel_launch_s=0.0))
    cp, batch_heads = 2, 8 / 2
    forward, backward = ring_pairs_time(_attention(batch_heads, 1024, 64, True), cp, compute)
    scores = 2 * 4 * 5 * 256 * 256
    seconds = SCORE_BYTES * scores / PRESETS["cpu"].memory_bandwidth * compute.scale
    assert forward == pytest.approx(RING_PAIR_SCORE_PASSES[0] * seconds)
    assert backward == pytest.approx(RING_PAIR_SCORE_PASSES[1] * seconds)
