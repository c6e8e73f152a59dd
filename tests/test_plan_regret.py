"""`benchmarks/plan_regret.py` at a tiny size: two models on 2 Gloo processes, planned
on the CPU preset (the benchmark calibrates a profile first, which takes a minute), each
with one runner-up, one round of one step. It checks what the lines say, never a time."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest


@pytest.mark.slow
def test_plan_regret_measures_the_free_plan_against_a_runner_up(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks"))
    from plan_regret import plan_and_measure, summary

    args = argparse.Namespace(alternatives=1, rounds=2, steps=1)
    lines = plan_and_measure(2, ["gpt2", "random_wide"], "cpu", args, tmp_path)

    for line in lines:
        assert line["failed"] == {}, line
        assert len(line["plans"]) == 2, line
        assert line["chosen"] == line["plans"][0]["plan"], line
        assert line["regret"] >= 1.0, line
        assert -1.0 <= line["spearman"] <= 1.0, line
    assert summary(lines, {2: (0.0, 0.0)})["results"] == 2
