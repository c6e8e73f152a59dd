"""A CPU rank keeps freed memory for reuse (runtime/host_memory.py): a training step
after the first ones faults in almost no fresh pages, where glibc's defaults mostly
fault in the large outputs and the optimizer's temporaries again every step (turned off,
`AUTOPART_KEEP_FREED_MEMORY=0`, this test fails)."""

from __future__ import annotations

import resource
import statistics

import torch

import autopart
from autopart.testing import run_world
from tests.models import lm_loss, make_optimizer, tiny_gpt2, token_batch

# Steady-state steps counted. Now and then one grows the heap by a few MiB (a free chunk
# in the wrong place) and faults in a few hundred pages: the median over this many steps
# stays clear of them.
STEPS = 20


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


# Pages a steady-state step may fault in with freed memory kept: a few, where glibc's
# defaults fault in hundreds to thousands a step (in most runs: its dynamic thresholds
# sometimes keep the blocks too, so the defaults are not asserted).
KEPT_FAULTS_AT_MOST = 16


def test_a_cpu_rank_reuses_freed_memory_instead_of_faulting_it_in():
    [kept] = run_world(_faults_per_step, 1)
    assert kept <= KEPT_FAULTS_AT_MOST, f"{kept:.0f} faults a step with freed memory kept"
