"""The solver weighs how many virtual stages an interleaved pipeline runs, on the meta
device: Llama-2-7B's shape (32 blocks) on 4 nodes of 8 H100s at tp 8 × pp 4, with 4
microbatches of one sequence, so that the bubble, (p-1)/(v·m) of the step, is large at
2 virtual stages and the search has room to shrink it (up to 8 chunks a rank)."""

from __future__ import annotations

import functools

import pytest
import torch

from autopart.mesh import Mesh
from tests.harness import plan_lm
from tests.models import llama2_7b_on_meta

TOKENS, SEQUENCES = 4096, 4
MESH = Mesh.cluster("h100-80g", nodes=4, per_node=8)
PINS = dict(tp=8, pp=4, schedule="interleaved-1f1b", microbatches=SEQUENCES, recompute=True)


@functools.cache
def _plan(virtual_stages: int | None):
    ids = torch.zeros(SEQUENCES, TOKENS, dtype=torch.long, device="meta")
    return plan_lm(llama2_7b_on_meta(TOKENS), ids, MESH, virtual_stages=virtual_stages, **PINS)


@pytest.mark.slow  # a deep model planned twice
def test_a_deep_pipeline_with_few_microbatches_runs_more_virtual_stages():
    chosen, two = _plan(None), _plan(2)
    assert chosen.virtual_stages > 2, chosen.explain()
    assert len(chosen.stage_cuts) == chosen.pp * chosen.virtual_stages - 1
    # The bubble shrinks as (p-1)/(v·m) says, and pays for the extra transfers.
    assert chosen.predicted.bubble_s < two.predicted.bubble_s * 2 / chosen.virtual_stages * 1.1
    assert chosen.predicted.step_time_s < two.predicted.step_time_s
