"""Context parallelism trains a causal Llama (sequence 64) like one device: cp=2 on 2
Gloo ranks; cp=2 × dp=2 (with ZeRO-0, 1 and 3), cp=2 × tp=2, with sequence
parallelism, and cp=2 × pp=2 (1F1B) on 4; 3 AdamW steps in fp32, every rank's losses
and parameters within 1e-5 of one device's. Each layer's attention runs as a ring, and
the only gather of the sequence is the logits'. Under plain data parallelism the
weights' gradients are summed over cp by the data-parallel sync (no all-reduce in
backward); under ZeRO, in backward."""

from __future__ import annotations

from collections import Counter

import pytest

import autopart
from autopart.testing import run_world
from tests.harness import (
    assert_every_rank_matches,
    case_key,
    parallelize_lm,
    train_case,
    train_losses,
)
from tests.models import tiny_llama, token_batch, train_reference

STEPS = 3
SEQ = 64
PARAMETERS = len(list(tiny_llama().parameters()))
CASES = {
    2: [{"cp": 2, "dp": 1, "tp": 1}],
    4: [
        {"cp": 2, "dp": 2, "tp": 1, "zero": 0},
        {"cp": 2, "dp": 2, "tp": 1, "zero": 1},
        {"cp": 2, "dp": 2, "tp": 1, "zero": 3},
        {"cp": 2, "dp": 1, "tp": 2},
        {"cp": 2, "dp": 1, "tp": 2, "sequence_parallel": True},
        {"cp": 2, "dp": 1, "tp": 1, "pp": 2, "schedule": "1f1b", "microbatches": 2},
    ],
}


def _graph_of(pm) -> dict:
    nodes = [n for stage in pm._stage_graphs() for n in stage.graph.nodes]
    targets = Counter(getattr(n.target, "__name__", str(n.target)) for n in nodes)
    kinds = Counter((info.axis, info.kind) for _, info in pm.collectives())
    return {"rings": targets["ring_attention"], "kinds": kinds, "summed": len(pm.cp_summed)}


def _train(batch, cases) -> dict:
    return {
        case_key("llama", pins): train_case(
            tiny_llama(), batch, STEPS, inspect=_graph_of, **{"pp": 1, **pins}
        )
        for pins in cases
    }


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_context_parallel_trains_like_one_device(world):
    batch = token_batch(4, SEQ)
    reference = train_reference(tiny_llama(), "adamw", STEPS, (batch[0],), batch[1])
    per_rank = run_world(_train, world, batch, CASES[world])
    for pins in CASES[world]:
        key = case_key("llama", pins)
        assert_every_rank_matches(per_rank, key, reference, label=pins)
        graphs = [r[key] for r in per_rank]
        pipelines = world // pins.get("pp", 1)  # ranks that hold every stage between them
        # Both layers' attention as rings; the logits gathered for the loss, once.
        assert sum(g["rings"] for g in graphs) == 2 * pipelines
        assert sum(g["kinds"][("cp", "all_gather")] for g in graphs) == pipelines
        in_backward = sum(g["kinds"][("cp", "all_reduce (backward)")] for g in graphs)
        summed = sum(g["summed"] for g in graphs)
        if pins.get("zero"):
            assert in_backward > 0 and summed == 0
        elif pins["tp"] == 1:  # every weight of the Llama reads this rank's tokens alone
            assert in_backward == 0 and summed == PARAMETERS * world


def _resume(batch, directory) -> list[float]:
    pm = parallelize_lm(tiny_llama(), batch, "adamw", cp=2, dp=2, tp=1, pp=1, zero=0)
    losses = train_losses(pm, batch, STEPS - 1)
    autopart.save_checkpoint(pm, directory)
    pm.close()
    pm = parallelize_lm(tiny_llama(), batch, "adamw", cp=1, dp=4, tp=1, pp=1, zero=1)
    autopart.load_checkpoint(pm, directory)
    losses += train_losses(pm, batch, 1)
    pm.close()
    return losses


@pytest.mark.slow
def test_a_checkpoint_of_a_context_parallel_plan_resumes_under_data_parallelism(tmp_path):
    """Parameters replicated over cp are saved once and read back under another plan:
    the resumed run follows one device's losses."""
    batch = token_batch(4, SEQ)
    reference = train_reference(tiny_llama(), "adamw", STEPS, (batch[0],), batch[1])
    for losses in run_world(_resume, 4, batch, str(tmp_path)):
        assert losses == pytest.approx(reference["losses"], rel=1e-5)
