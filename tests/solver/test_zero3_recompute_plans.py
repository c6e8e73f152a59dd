"""Planning ZeRO-3 with activation recomputation (FSDP with activation checkpointing),
on the meta device: Llama 3.1 8B's shape at 8192 tokens, 2 sequences per rank, bf16
mixed precision, as torchtitan trains it on H100-80GB.

With ZeRO-3 pinned and recomputation left to the solver, a plan fits 80 GB on one
node of 8 and on 16 nodes of 8. Pinned to data parallelism alone over 8 ranks, with
one microbatch, the activations of 32 blocks cannot fit (over 200 GB a rank): the
inner model recomputes blocks until they do, and no more than that."""

from __future__ import annotations

import pytest
import torch

from autopart.mesh import Mesh
from tests.harness import plan_lm
from tests.models import llama3_8b_on_meta

TOKENS, PER_RANK, BLOCKS = 8192, 2, 32
GiB = 1024**3


def _plan(nodes: int, **pins):
    mesh = Mesh.cluster("h100-80g", nodes=nodes, per_node=8)
    ids = torch.zeros(PER_RANK * mesh.world_size, TOKENS, dtype=torch.long, device="meta")
    return plan_lm(llama3_8b_on_meta(TOKENS), ids, mesh, zero=3, **pins)


@pytest.mark.slow
def test_zero3_over_8_ranks_recomputes_the_blocks_memory_needs():
    plan = _plan(1, dp=8, microbatches=1)
    assert plan.predicted.peak_memory_bytes <= 80 * GiB, plan.explain()
    assert 0 < len(plan.recompute) < BLOCKS, plan.explain()


@pytest.mark.slow
@pytest.mark.parametrize("nodes", [1, 16])
def test_zero3_with_recomputation_left_free_fits(nodes):
    plan = _plan(nodes)
    assert plan.zero == 3
    assert plan.predicted.peak_memory_bytes <= 80 * GiB, plan.explain()
