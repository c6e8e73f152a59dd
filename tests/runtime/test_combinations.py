"""Axis combinations no other test runs, with SGD: plain SGD (momentum 0.9, lr 0.1)
moves the parameters by the gradients themselves, so a gradient scaled wrong (a
missing 1/dp, a doubled tensor-parallel all-reduce) shows in the parameters at once,
where AdamW's normalization would all but hide it. A world of 4, 3 steps each, against
one device. Slow: run by `.ci/run`, not by the README's quick test command."""

from __future__ import annotations

import functools

import pytest

from autopart.testing import run_world
from tests.harness import assert_every_rank_matches, case_key, train_case
from tests.models import LM_FACTORIES, token_batch, train_single_device

pytestmark = pytest.mark.slow

STEPS = 3
LAYERS = 4  # 2 stages × 2 virtual stages of interleaved 1F1B, one block each
BATCH = token_batch(batch=8)
PP2 = {"pp": 2, "schedule": "1f1b", "microbatches": 2}
INTERLEAVED = {"pp": 2, "schedule": "interleaved-1f1b", "virtual_stages": 2, "microbatches": 2}
CASES = [
    ("gpt2", {"dp": 2, "tp": 2, "zero": 3}),
    ("llama", {"dp": 2, "tp": 2, "zero": 3}),
    ("llama", {"dp": 2, "tp": 2, "zero": 1}),
    ("gpt2", {"dp": 2, "zero": 1, **PP2}),
    ("llama", {"dp": 2, "zero": 0, **PP2}),
    ("gpt2", {"dp": 2, **INTERLEAVED}),
    ("llama", {"tp": 2, **INTERLEAVED}),
]


def _train(cases, batch) -> dict:
    return {
        case_key(name, pins): train_case(
            LM_FACTORIES[name](layers=LAYERS), batch, STEPS, "sgd", **pins
        )
        for name, pins in cases
    }


@functools.cache
def _world() -> list[dict]:
    return run_world(_train, 4, CASES, BATCH)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_combination_matches_single_device_with_sgd(case):
    name, pins = case
    reference = train_single_device(name, "sgd", STEPS, BATCH, layers=LAYERS)
    assert_every_rank_matches(_world(), case_key(name, pins), reference, label=case)
