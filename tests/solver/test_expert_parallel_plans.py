"""Planning expert parallelism, on the meta device: Mixtral-8x7B's shape (46.7B
parameters, 45B of them in 8 experts per layer) on 8 nodes of 8 H100s, 256 sequences
of 4096 tokens per step, in bf16 mixed precision.

Replicated, the experts do not fit; split over tp they cost two all-reduces of every
token's activations per layer. Split over ep, each rank holds 1/ep of them and every
routed row crosses two all_to_alls per layer instead. The search weighs them, and the
plan it chooses is the fastest the cost model predicts, against the best with ep = 1.
ZeRO-2 is pinned, so that each rank holds the weights it computes with: ZeRO-3 (with
recomputation) shards the experts over dp as well, a third way, which the cost model
prices about alike with ep = 1 and ep = 2."""

from __future__ import annotations

import pytest
import torch

from autopart.mesh import Mesh
from tests.harness import plan_lm
from tests.models import mixtral_8x7b_on_meta

SEQUENCES, TOKENS = 256, 4096
MESH = Mesh.cluster("h100-80g", nodes=8, per_node=8)


def _plan(**pins):
    ids = torch.zeros(SEQUENCES, TOKENS, dtype=torch.long, device="meta")
    return plan_lm(mixtral_8x7b_on_meta(TOKENS), ids, MESH, zero=2, **pins)


@pytest.mark.slow
def test_expert_parallelism_is_chosen_where_the_model_predicts_it_faster():
    plan = _plan()
    without = _plan(ep=1)
    assert plan.ep > 1, plan.explain()
    assert plan.predicted.step_time_s < without.predicted.step_time_s
    assert plan.predicted.peak_memory_bytes <= MESH.device.memory_bytes
