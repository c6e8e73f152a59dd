"""A sparse mixture-of-experts decoder (tiny Mixtral, routed experts in every layer):
its layers are recognized as copies of one block although each routes a data-dependent
number of tokens, so a two-layer model cuts into two pipeline stages; dp=2 and pp=2
train like one device (fp32, 3 AdamW steps, Gloo)."""

from __future__ import annotations

from autopart.capture import capture
from autopart.ops.meta import BLOCK
from autopart.passes import analyze
from autopart.testing import run_world
from tests.harness import assert_every_rank_matches, case_key, train_case
from tests.models import tiny_mixtral, token_batch, train_reference

STEPS = 3
CASES = [{"dp": 2}, {"pp": 2, "schedule": "1f1b", "microbatches": 2}]


def test_routed_layers_are_one_block():
    captured = capture(tiny_mixtral(), (token_batch(8)[0],))
    analyze(captured.gm, captured.context())
    kinds = {b.instance: b.block_id for n in captured.gm.graph.nodes if (b := BLOCK.get(n))}
    assert sorted(kinds) == ["model.layers.0", "model.layers.1"]
    assert len(set(kinds.values())) == 1


def _train(batch) -> dict:
    return {
        case_key("mixtral", pins): train_case(tiny_mixtral(), batch, STEPS, **pins)
        for pins in CASES
    }


def test_mixture_of_experts_trains_like_one_device_under_dp_and_pp():
    batch = token_batch(8)
    reference = train_reference(tiny_mixtral(), "adamw", STEPS, (batch[0],), batch[1])
    per_rank = run_world(_train, 2, batch)
    for pins in CASES:
        assert_every_rank_matches(per_rank, case_key("mixtral", pins), reference, label=pins)
