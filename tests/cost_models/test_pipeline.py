"""Pipeline step time and bubble fractions (GPipe, 1F1B, interleaved 1F1B) and the
exposed part of gradient synchronization."""

from __future__ import annotations

import pytest

from autopart.cost_models.pipeline import (
    bubble_fraction,
    bucket_sizes,
    exposed_sync,
    pipeline_step,
)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_is_p_minus_one_over_m(schedule):
    # Narayanan et al. 2021, section 2.2.1: (p − 1)/m.
    assert bubble_fraction(schedule, stages=4, microbatches=8) == pytest.approx(3 / 8)
    assert bubble_fraction(schedule, stages=8, microbatches=64) == pytest.approx(7 / 64)


def test_interleaved_bubble_is_divided_by_the_virtual_stages():
    # Narayanan et al. 2021, section 2.2.2: (p − 1)/(v·m).
    assert bubble_fraction("interleaved-1f1b", 4, 8, virtual_stages=2) == pytest.approx(3 / 16)
    assert bubble_fraction("interleaved-1f1b", 8, 32, virtual_stages=4) == pytest.approx(7 / 128)


def test_no_pipeline_has_no_bubble():
    assert bubble_fraction(None, 1, 8) == 0.0
    assert bubble_fraction("1f1b", 1, 8) == 0.0


def test_step_is_m_plus_p_minus_one_slowest_stages():
    p, m = 4, 8
    step = pipeline_step([1.0, 1.5, 1.0, 1.2], [0.0, 0.5, 0.0, 0.1], m, "1f1b")
    slowest = 1.5 + 0.5
    assert step.total == pytest.approx((m + p - 1) * slowest)
    assert step.compute == pytest.approx(m * 1.5)
    assert step.exposed_comm == pytest.approx(m * 0.5)
    assert step.bubble == pytest.approx((p - 1) * slowest)


def test_interleaved_step_shrinks_the_bubble():
    p, m, v = 4, 8, 2
    step = pipeline_step([1.0] * p, [0.0] * p, m, "interleaved-1f1b", v)
    assert step.total == pytest.approx(m + (p - 1) / v)


def test_sync_hidden_behind_backward_but_the_last_bucket():
    assert exposed_sync(sync=3.0, overlappable=5.0, last_bucket=0.5) == 0.5
    assert exposed_sync(sync=8.0, overlappable=5.0, last_bucket=0.5) == pytest.approx(3.0)


def test_buckets():
    assert bucket_sizes(60, 25) == [25, 25, 10]
    assert bucket_sizes(50, 25) == [25, 25]
    assert bucket_sizes(0, 25) == []
