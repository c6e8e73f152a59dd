"""Context parallelism trains a causal Llama (sequence 64) like one device: cp=2 on 2
Gloo ranks; cp=2 × dp=2 (with ZeRO-0 and ZeRO-1), cp=2 × tp=2 and with sequence
parallelism on 4; 3 AdamW steps in fp32, every rank's losses and parameters within 1e-5
of one device's. Each layer's attention runs as a ring, and the only gather of the
sequence is the logits'. Under plain data parallelism the weights' gradients are summed
over cp by the data-parallel sync (no all-reduce in backward); under ZeRO, in backward."""

from __future__ import annotations

from collections import Counter

import pytest

from autopart.testing import run_world
from tests.harness import assert_every_rank_matches, case_key, train_case
from tests.models import tiny_llama, token_batch, train_reference

STEPS = 3
SEQ = 64
PARAMETERS = len(list(tiny_llama().parameters()))
CASES = {
    2: [{"cp": 2, "dp": 1, "tp": 1}],
    4: [
        {"cp": 2, "dp": 2, "tp": 1, "zero": 0},
        {"cp": 2, "dp": 2, "tp": 1, "zero": 1},
        {"cp": 2, "dp": 1, "tp": 2},
        {"cp": 2, "dp": 1, "tp": 2, "sequence_parallel": True},
    ],
}


def _graph_of(pm) -> dict:
    (stage,) = pm._stage_graphs()
    targets = Counter(getattr(n.target, "__name__", str(n.target)) for n in stage.graph.nodes)
    kinds = Counter((info.axis, info.kind) for _, info in pm.collectives())
    return {"rings": targets["ring_attention"], "kinds": kinds, "summed": len(pm.cp_summed)}


def _train(batch, cases) -> dict:
    return {
        case_key("llama", pins): train_case(
            tiny_llama(), batch, STEPS, inspect=_graph_of, pp=1, **pins
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
        graph = per_rank[0][key]
        assert graph["rings"] == 2  # both layers' attention
        assert graph["kinds"][("cp", "all_gather")] == 1  # the logits, for the loss
        in_backward = graph["kinds"][("cp", "all_reduce (backward)")]
        if pins.get("zero"):
            assert in_backward > 0 and graph["summed"] == 0
        elif pins["tp"] == 1:  # every weight of the Llama reads this rank's tokens alone
            assert in_backward == 0 and graph["summed"] == PARAMETERS
