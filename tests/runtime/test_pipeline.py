"""Pipeline parallelism trains to the single-device losses and parameters (fp32, Gloo).

Several plans share one spawned world, to pay the start-up once. GPT-2 ties its input
embedding to its output head, so its first and last stages share a parameter (on
different ranks): that exercises the replica exchange.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopart
from autopart.testing import run_world
from tests.harness import assert_every_rank_matches, parallelize_lm, train_case
from tests.models import LM_FACTORIES, VOCAB, token_batch, train_reference, train_single_device

STEPS = 5

# The quick suite runs each schedule once, GPT-2's tied weights across stages among
# them, on a block a stage; the slow sweeps the other model of each, on two blocks a
# stage.
WORLD_2 = [  # (name, model, layers, pins)
    ("gpt2 PP2 1F1B", "gpt2", 2, dict(pp=2, schedule="1f1b", microbatches=4)),
    ("llama PP2 GPipe", "llama", 2, dict(pp=2, schedule="gpipe", microbatches=4)),
]
MORE_WORLD_2 = [
    ("gpt2 PP2 GPipe", "gpt2", 4, dict(pp=2, schedule="gpipe", microbatches=2)),
    ("llama PP2 1F1B", "llama", 4, dict(pp=2, schedule="1f1b", microbatches=2)),
]
# 8 stages (pp=4 × 2 virtual) need 8 layers: one block per stage, the embedding with the
# first and the head with the last.
INTERLEAVED = dict(pp=4, schedule="interleaved-1f1b", virtual_stages=2, microbatches=4)
WORLD_4 = [
    ("gpt2 PP4 interleaved", "gpt2", 8, INTERLEAVED),
    ("llama PP4 interleaved", "llama", 8, INTERLEAVED),
    ("gpt2 TP2×PP2 1F1B", "gpt2", 4, dict(tp=2, pp=2, schedule="1f1b", microbatches=2)),
    ("llama TP2×PP2 1F1B", "llama", 4, dict(tp=2, pp=2, schedule="1f1b", microbatches=2)),
]


def _train_pipelined(cases, batch) -> dict:
    return {
        name: train_case(LM_FACTORIES[model_name](layers=layers), batch, STEPS, **pins)
        for name, model_name, layers, pins in cases
    }


def _check(cases, world: int) -> None:
    batch = token_batch(batch=8)
    per_rank = run_world(_train_pipelined, world, cases, batch)
    for name, model_name, layers, _ in cases:
        reference = train_single_device(model_name, "adamw", STEPS, batch, layers=layers)
        # This also checks that the gathered parameters carry exactly the model's names,
        # tied ones once, as the reference's do.
        assert_every_rank_matches(per_rank, name, reference)


@pytest.mark.parametrize("cases", [WORLD_2, pytest.param(MORE_WORLD_2, marks=pytest.mark.slow)])
def test_two_stage_schedules_match_single_device(cases):
    _check(cases, 2)


@pytest.mark.slow  # 4 ranks, 30 s: the quick suite keeps the 2-stage schedules
def test_interleaved_and_composed_pipelines_match_single_device():
    _check(WORLD_4, 4)


# The solver runs up to 8 virtual stages a rank (`search.MAX_VIRTUAL_STAGES`): 4 a rank
# over 8 blocks, and 3 a rank, whose 6 chunks hold the 8 blocks unevenly.
DEEP_INTERLEAVED = [
    ("llama PP2 × 4 virtual", "llama", 8, dict(pp=2, schedule="interleaved-1f1b",
                                               virtual_stages=4, microbatches=4)),
    ("gpt2 PP2 × 3 virtual", "gpt2", 8, dict(pp=2, schedule="interleaved-1f1b",
                                             virtual_stages=3, microbatches=2)),
]  # fmt: skip


@pytest.mark.slow  # another world of 2
def test_more_virtual_stages_match_single_device():
    _check(DEEP_INTERLEAVED, 2)


# Stages the inner solver may choose: uneven cuts, and some blocks recomputed (those of
# the first stage, which holds the most microbatches in flight under 1F1B).
UNEVEN = [  # (name, model, layers, world, pins, stage cuts, recomputed blocks)
    (
        "gpt2 PP2 1|3, first block recomputed",
        "gpt2",
        4,
        2,
        dict(pp=2, schedule="1f1b", microbatches=4),
        ("transformer.h.1",),
        ("transformer.h.0",),
    ),
    (
        "llama PP2 3|1",
        "llama",
        4,
        2,
        dict(pp=2, schedule="gpipe", microbatches=2),
        ("model.layers.3",),
        (),
    ),
    (
        "gpt2 PP4 1|1|2|2",
        "gpt2",
        6,
        4,
        dict(pp=4, schedule="1f1b", microbatches=4),
        ("transformer.h.1", "transformer.h.2", "transformer.h.4"),
        (),
    ),
    (
        "llama PP4 2|2|1|1, stages 0-1 partly recomputed",
        "llama",
        6,
        4,
        dict(pp=4, schedule="1f1b", microbatches=4),
        ("model.layers.2", "model.layers.4", "model.layers.5"),
        ("model.layers.0", "model.layers.2"),
    ),
]


def _train_uneven(cases, batch) -> dict:
    out = {}
    for name, model_name, layers, _, pins, cuts, recompute in cases:
        model = LM_FACTORIES[model_name](layers=layers)
        chosen = autopart.plan(model, autopart.Mesh.local(), (batch[0],), **pins)
        plan = chosen.with_changes(stage_cuts=cuts, recompute=recompute)
        out[name] = train_case(model, batch, STEPS, inspect=_blocks_held, plan=plan)
    return out


def _blocks_held(pm) -> dict:
    """The indices of the blocks whose parameters this rank holds."""
    found = (re.search(r"(?:^|\.)(?:h|layers)\.(\d+)\.", n) for n, _ in pm.named_parameters())
    return {"blocks": sorted({int(m[1]) for m in found if m})}


@pytest.mark.slow  # uneven cuts; the quick suite keeps the even 2-stage schedules
@pytest.mark.parametrize("world", [2, 4])
def test_uneven_stages_and_partial_recomputation_match_single_device(world):
    batch = token_batch(batch=8)
    cases = [case for case in UNEVEN if case[3] == world]
    per_rank = run_world(_train_uneven, world, cases, batch)
    for name, model_name, layers, _, _, cuts, _ in cases:
        reference = train_single_device(model_name, "adamw", STEPS, batch, layers=layers)
        assert_every_rank_matches(per_rank, name, reference)
        starts = [0, *(int(c.rpartition(".")[2]) for c in cuts), layers]
        for rank, results in enumerate(per_rank):
            assert results[name]["blocks"] == list(range(starts[rank], starts[rank + 1]))


def _batch_of_another_shape(batch) -> dict:
    """A step whose sequence is longer than the model's positions (64): every rank
    raises the same error before the step's first collective, under a pipeline and
    without one."""
    ids, target = batch
    longer = (ids.repeat(1, 5), target.repeat(1, 5))
    messages = {}
    for pins in ({"pp": 2, "schedule": "1f1b", "microbatches": 2}, {"dp": 2}):
        pm = parallelize_lm(LM_FACTORIES["llama"](layers=4), batch, **pins)
        try:
            pm.train_step(*longer)
            messages[tuple(pins)] = "no error"
        except autopart.BatchError as e:
            messages[tuple(pins)] = str(e)
        pm.close()
    return messages


@pytest.mark.slow  # test_shapes checks the same refusal on every rank without a pipeline
def test_a_batch_of_another_shape_fails_on_every_rank_at_once():
    per_rank = run_world(_batch_of_another_shape, 2, token_batch(batch=8))
    assert per_rank[0] == per_rank[1]
    for message in per_rank[0].values():
        assert "input 0 of train_step has shape (8, 80)" in message, message
        assert "dim 1 (seq) is 80, outside the 2..64 the model allows" in message, message


class _TiedLastStage(nn.Module):
    """A residual MLP applied twice with the same weights, and a head tied to the
    embedding: cut in two, the second stage holds the repeated block and the head,
    every weight of it shared with the first stage's, none of its own."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        block = _Residual(width)
        self.layers = nn.ModuleList([block, block])
        self.head = nn.Linear(width, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class _Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


TIED_LAST_STAGE = {  # name -> pins
    "PP2 GPipe": dict(pp=2, schedule="gpipe", microbatches=1),
    "PP2 1F1B": dict(pp=2, schedule="1f1b", microbatches=2),
}


def _own_parameters(pm) -> dict:
    return {"parameters": len(list(pm.parameters()))}


def _train_tied_last_stage(batch) -> dict:
    return {
        name: train_case(_seeded(_TiedLastStage), batch, STEPS, inspect=_own_parameters, **pins)
        for name, pins in TIED_LAST_STAGE.items()
    }


def _seeded(factory):
    torch.manual_seed(0)
    return factory()


def test_a_stage_whose_weights_are_all_tied_to_an_earlier_stage_trains_like_one_device():
    """The last stage has no parameters of its own: it steps nothing, and its replicas'
    gradients still reach their owners in the first stage, which trains them as one
    device does."""
    batch = token_batch(batch=8)
    per_rank = run_world(_train_tied_last_stage, 2, batch)
    reference = train_reference(_seeded(_TiedLastStage), "adamw", STEPS, (batch[0],), batch[1])
    for name in TIED_LAST_STAGE:
        assert_every_rank_matches(per_rank, name, reference)
        assert [r[name]["parameters"] for r in per_rank] == [7, 0], name
