"""Every pin given as a string or a module path is checked before planning: a typo, a
block the model does not have or a schedule in the wrong case is refused, naming what
is accepted and the nearest valid choices, instead of being printed as active while
nothing acts on it."""

from __future__ import annotations

import functools
import re

import pytest

import autopart
from autopart.capture import capture
from autopart.passes import analyze
from autopart.plan import PlanError
from autopart.solver import Pins, make_plan, recompute_refusal
from tests.models import tiny_llama, token_batch


@functools.cache
def _captured():
    captured = capture(tiny_llama(layers=2), (token_batch()[0],))
    analyze(captured.gm, captured.context())
    return captured


def _plan(**pins):
    mesh = autopart.Mesh.cluster("cpu", nodes=1, per_node=2)
    return make_plan(_captured(), mesh, Pins.of(**pins))


@pytest.mark.parametrize(
    ("pins", "nearest"),
    [
        ({"recompute": ("model.layer.0",)}, r"nearest: 'model\.layers\.0'"),
        ({"recompute": ("model.layers.7",)}, r"nearest: 'model\.layers\.[01]'"),
        ({"recompute": "al"}, r"nearest: 'all'"),
        ({"recompute_attention": ("model.layers.0", "model.layer.1")}, r"'model\.layers\.1'"),
    ],
    ids=["typo", "no-such-layer", "word", "attention"],
)
def test_a_recompute_path_that_names_no_block_is_refused_with_the_nearest(pins, nearest):
    with pytest.raises(PlanError, match="which is no block of the model") as refused:
        _plan(**pins)
    message = str(refused.value)
    assert re.search(nearest, message), message
    assert "'model.layers.0', 'model.layers.1'" in message  # the blocks there are
    assert "what holds them ('model.layers')" in message
    if "recompute" in pins:
        assert "recompute takes 'all', 'none', 'attention', or module paths" in message


def test_recompute_paths_of_blocks_and_of_their_stack_still_plan():
    assert _plan(recompute=("model.layers.1",)).recompute == ("model.layers.1",)
    assert _plan(recompute="model.layers").recompute == ("model.layers",)
    selective = _plan(recompute_attention="all").recompute_attention
    assert selective == ("model.layers.0", "model.layers.1")


def test_a_plan_edited_to_recompute_a_missing_block_is_named():
    """What `parallelize(plan=...)` can ask of a plan made or edited elsewhere."""
    gm = _captured().gm
    assert recompute_refusal(gm, ("model.layers.0",), True) is None
    refusal = recompute_refusal(gm, (), ("model.layers.2",))
    assert refusal and refusal.startswith("recompute_attention names 'model.layers.2'")


@pytest.mark.parametrize(
    ("pins", "accepted"),
    [
        ({"schedule": "1F1B"}, r"schedule must be one of \['gpipe', '1f1b', 'interleaved-1f1b'\]"),
        ({"schedule": "zero-bubble"}, r"schedule must be one of \['gpipe', '1f1b'"),
        ({"master_weights": "cpu"}, r"master_weights must be one of \['device', 'host'\]"),
        ({"grad_compression": "fp8"}, r"grad_compression must be 'bf16' or 'powersgd:rank=R'"),
        ({"outer_optimizer": "adam"}, r"outer_optimizer must be 'sgd:lr=L"),
        ({"precision": "half"}, r"precision must be one of \['fp32', 'bf16-mixed'"),
    ],
    ids=["schedule-case", "schedule", "master-weights", "compression", "outer", "precision"],
)
def test_an_unknown_string_pin_lists_the_valid_choices(pins, accepted):
    with pytest.raises(PlanError, match=accepted):
        Pins.of(**pins)


def test_a_schedule_in_the_wrong_case_names_the_one_meant():
    with pytest.raises(PlanError, match=r"not '1F1B' \(did you mean '1f1b'\?\)"):
        autopart.plan(
            tiny_llama(),
            autopart.Mesh.cluster("cpu", 1, 2),
            (token_batch()[0],),
            pp=2,
            schedule="1F1B",
        )


def test_pinned_parts_that_do_not_split_the_batch_together_are_refused():
    """dp=2 and microbatches=8 each divide a batch of 8, but not together: a PlanError
    that names both and the fix, not an error from deep in the cost model."""
    with pytest.raises(PlanError, match=r"dp=2 × microbatches=8 = 16 equal parts"):
        _plan(dp=2, microbatches=8)
