"""`parallelize(..., compile=True)`: each rank's programs compiled by inductor (its C++
backend on the CPU) train like the same plan uncompiled, within 1e-4, under each axis.
Inductor compiles slowly on a CPU (a minute or more a case on 2 cores): every case
runs with the slow tests."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F

import autopart
from autopart.testing import run_world
from tests.harness import parallelize_lm
from tests.models import MLP, assert_matches, make_optimizer, tiny_llama, token_batch

STEPS = 3


def _mlp_losses(compile: bool) -> dict:
    torch.manual_seed(0)
    x, y = torch.randn(8, 32), torch.randint(0, 4, (8,))
    pm = autopart.parallelize(
        MLP(),
        autopart.Mesh.local(),
        (x,),
        loss_fn=F.cross_entropy,
        optimizer=make_optimizer("adamw"),
        dp=2,
        compile=compile,
    )
    result = {"losses": [pm.train_step(x, y).item() for _ in range(STEPS)]}
    result["params"] = pm.full_state_dict()
    pm.close()
    return result


@pytest.mark.slow  # inductor's C++ compile takes about a minute on 2 cores
def test_a_compiled_data_parallel_step_matches_the_eager_one():
    compiled = run_world(_mlp_losses, 2, True)
    eager = run_world(_mlp_losses, 2, False)
    for got, want in zip(compiled, eager, strict=True):
        assert_matches(got, want, rtol=1e-4)


def _llama_losses(pins: dict, compile: bool) -> dict:
    batch = token_batch(batch=8)
    pm = parallelize_lm(tiny_llama(), batch, "adamw", compile=compile, **pins)
    result = {"losses": [pm.train_step(*batch).item() for _ in range(STEPS)]}
    result["params"] = pm.full_state_dict()
    pm.close()
    return result


PLANS = [
    {"dp": 2, "zero": 0},
    {"dp": 2, "zero": 1},
    {"dp": 2, "zero": 2},
    {"dp": 2, "zero": 3},
    {"tp": 2},
    {"pp": 2, "microbatches": 2},
    {"dp": 2, "tp": 2, "zero": 1},
]


@pytest.mark.slow
@pytest.mark.parametrize("pins", PLANS, ids=lambda p: ",".join(f"{k}{v}" for k, v in p.items()))
def test_compiled_plans_match_the_uncompiled_plan(pins):
    world = math.prod(pins.get(axis, 1) for axis in ("dp", "tp", "pp"))
    compiled = run_world(_llama_losses, world, pins, True)
    eager = run_world(_llama_losses, world, pins, False)
    for got, want in zip(compiled, eager, strict=True):
        assert_matches(got, want, rtol=1e-4)


def _bf16_sgd(compile: bool) -> dict:
    batch = token_batch(batch=8)
    pins = {"dp": 2, "zero": 3, "precision": "bf16-params"}
    pm = parallelize_lm(tiny_llama(), batch, "sgd", compile=compile, **pins)
    result = {"losses": [pm.train_step(*batch).item() for _ in range(STEPS)]}
    result["params"] = pm.full_state_dict()
    pm.close()
    return result


@pytest.mark.slow
def test_compiled_sixteen_bit_parameters_track_the_uncompiled_plan():
    """ZeRO-3 over bf16 parameters, compiled: inductor's fused kernels round to bf16 once
    where eager operators round after each, so the two agree to bf16's rounding: losses
    within two units in the last place, SGD's updates within 3% of their size."""
    compiled = run_world(_bf16_sgd, 2, True)[0]
    eager = run_world(_bf16_sgd, 2, False)[0]
    init = dict(tiny_llama().named_parameters())
    for got, want in zip(compiled["losses"], eager["losses"], strict=True):
        assert abs(got - want) <= 2.0**-6 * abs(want)
    for name, want in eager["params"].items():
        update = (want - init[name].detach()).norm()
        assert float((compiled["params"][name] - want).norm() / update) <= 0.03, name


@pytest.mark.slow  # inductor's C++ compile
def test_each_graphs_compile_time_is_logged_once(caplog, monkeypatch, tmp_path):
    """A stage's forward is compiled on its first call and its backward when backward
    first reaches it (AOTAutograd compiles it lazily): each logged once, with its time."""
    from torch import fx, nn

    from autopart.runtime.compiled import Compiled

    # A graph inductor compiled before, in any process on this machine, is loaded from
    # its on-disk caches instead of compiled: nothing to log. A cache of its own makes
    # this test's graphs compile as on a fresh machine.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))

    stage = Compiled(fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU())))
    x = torch.randn(2, 4)
    with caplog.at_level(logging.INFO, logger="autopart.compile"):
        for _ in range(2):
            stage(x).sum().backward()
    logged = [r.getMessage() for r in caplog.records if r.name == "autopart.compile"]
    assert [m.split(" of a graph")[0] for m in logged] == [
        "autopart: inductor compiled the forward",
        "autopart: inductor compiled the backward",
    ]
    assert all(m.endswith(" s") for m in logged)
