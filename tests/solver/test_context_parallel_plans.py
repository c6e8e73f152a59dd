"""Planning context parallelism, on the meta device: Llama-3-8B's shape at 128k tokens
per sequence on 8 nodes of 8 H100s (bf16 mixed precision, the cross-entropy on logits
sharded over the vocabulary, as `benchmarks/plan_speed.py` plans it).

One sequence per step leaves data parallelism nothing to split and a pipeline nothing
to fill: without cp no plan fits, with cp=8 × tp=8 one does. At 8 sequences per step
data parallelism takes them: the ring runs each pair of 8k-token chunks as unfused
operators over its 8k × 8k scores of every head, which one device's fused attention
keeps in its tiles."""

from __future__ import annotations

import pytest
import torch

from autopart.api import captured_for_planning
from autopart.mesh import Mesh
from autopart.plan import PlanError
from autopart.solver import Pins, make_plan
from tests.harness import plan_lm
from tests.models import MLP, llama3_8b_on_meta, tiny_llama, token_batch

TOKENS = 131072
MESH = Mesh.cluster("h100-80g", nodes=8, per_node=8)


def _plan(batch: int, **pins):
    ids = torch.zeros(batch, TOKENS, dtype=torch.long, device="meta")
    return plan_lm(llama3_8b_on_meta(positions=TOKENS), ids, MESH, **pins)


@pytest.mark.slow
def test_one_long_sequence_is_split_over_context_parallel_ranks():
    plan = _plan(1)
    assert plan.cp > 1 and plan.dp == 1 and plan.pp == 1
    assert plan.predicted.peak_memory_bytes <= MESH.device.memory_bytes
    assert "Context parallelism splits every sequence over the 8 cp ranks" in plan.explain()
    with pytest.raises(PlanError, match="no plan"):
        _plan(1, cp=1)


@pytest.mark.slow
def test_context_parallelism_is_left_where_the_model_predicts_it_slower():
    plan = _plan(8)
    ring = _plan(8, cp=8)
    assert plan.cp == 1
    assert plan.predicted.step_time_s < ring.predicted.step_time_s


@pytest.mark.slow
def test_pinned_context_parallelism_needs_a_sequence_it_can_split():
    """A model with no token input, a sequence that does not cut into 2·cp chunks, and
    attention that ring attention cannot replace (eager), are refused before any
    search, each saying what to change."""
    two_cpus = Mesh.cluster("cpu", nodes=1, per_node=2)
    with pytest.raises(PlanError, match="no token input"):
        make_plan(captured_for_planning(MLP(), (torch.randn(4, 32),)), two_cpus, Pins.of(cp=2))
    ids, _ = token_batch(4, 6)
    with pytest.raises(PlanError, match="2·cp = 4 chunks, but the sequence has 6 tokens"):
        make_plan(captured_for_planning(tiny_llama(), (ids,)), two_cpus, Pins.of(cp=2))
    ids, _ = token_batch(4, 8)
    eager = tiny_llama()
    eager.config._attn_implementation = "eager"  # a matmul, a softmax and a matmul
    with pytest.raises(PlanError, match="does not call scaled_dot_product_attention"):
        make_plan(captured_for_planning(eager, (ids,)), two_cpus, Pins.of(cp=2))
