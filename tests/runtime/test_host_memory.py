"""A CPU rank keeps freed memory for reuse (runtime/host_memory.py): a training step
after the first ones faults in almost no fresh pages, where glibc's defaults fault in
the large outputs and the optimizer's temporaries again every step."""

from __future__ import annotations

import resource
import statistics

import torch

import autopart
from autopart.runtime.host_memory import ENVIRONMENT
from autopart.testing import run_world
from tests.models import lm_loss, make_optimizer, tiny_gpt2, token_batch

STEPS = 5


def _faults_per_step() -> float:
    """Minor page faults of this rank's steady-state training steps: the median over
    steps, so that a step where Python's own heap grows does not count."""
    torch.manual_seed(0)
    ids, target = token_batch(16, 64)
    pm = autopart.parallelize(
        tiny_gpt2(),
        autopart.Mesh.local(),
        (ids,),
        loss_fn=lm_loss,
        optimizer=make_optimizer("adamw"),
        dp=1,
    )
    for _ in range(3):  # the warm-up: the optimizer's state, the heap's growth
        pm.train_step(ids, target)
    faults = []
    for _ in range(STEPS):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        pm.train_step(ids, target)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    pm.close()
    return statistics.median(faults)


def test_a_cpu_rank_reuses_freed_memory_instead_of_faulting_it_in(monkeypatch):
    [kept] = run_world(_faults_per_step, 1)
    monkeypatch.setenv(ENVIRONMENT, "0")
    [fresh] = run_world(_faults_per_step, 1)
    assert fresh > 100, f"{fresh:.0f} faults a step under glibc's defaults"
    assert kept < fresh / 10, f"{kept:.0f} faults a step kept, {fresh:.0f} fresh"
