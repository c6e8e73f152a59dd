"""The pipeline split: stage modules at the plan's cuts, on one process."""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace

import pytest
import torch

from autopart.capture import capture
from autopart.degrees import Axis
from autopart.ops.stage_info import SharedParameter, pipeline_info
from autopart.passes import MODULE_PATH, PARAMS, analyze
from autopart.passes.pipeline_split import assign_stages, pipeline_stages, split_stages
from autopart.passes.runner import RankTarget
from autopart.plan import PlanError
from tests.models import LM_FACTORIES, token_batch

# Three stages each; the second cut falls inside a block.
CUTS = {
    "gpt2": ("transformer.h.1", "transformer.h.2.mlp"),
    "llama": ("model.layers.1", "model.layers.3.self_attn"),
}


@functools.cache
def _captured(model_name: str):
    """Splitting leaves the captured graph as it is, so tests share one capture."""
    model = LM_FACTORIES[model_name](layers=4)
    ids, _ = token_batch()
    captured = capture(model, (ids,))
    ctx = captured.context()
    analyze(captured.gm, ctx)
    return model, captured, ctx, ids


@pytest.mark.parametrize("model_name", ["gpt2", "llama"])
def test_chained_stages_reproduce_the_whole_graph_exactly(model_name):
    _, captured, ctx, ids = _captured(model_name)
    stages = pipeline_stages(captured.gm, CUTS[model_name], ctx)
    assert len(stages) == 3
    values = stages[0](ids)  # called as the model is
    for stage in stages[1:]:
        placeholders = stage.graph.find_nodes(op="placeholder")
        assert all(isinstance(p.meta["val"], torch.Tensor) for p in placeholders)
        assert isinstance(values, tuple)
        values = stage(*values)
    expected = captured.gm(ids)
    assert type(values) is type(expected)  # the model's output structure, for the loss
    assert torch.equal(values.logits, expected.logits)


@pytest.mark.parametrize("model_name", ["gpt2", "llama"])
def test_each_parameter_lives_in_one_stage_under_its_fqn(model_name):
    model, captured, ctx, _ = _captured(model_name)
    stages = pipeline_stages(captured.gm, CUTS[model_name], ctx)
    held = [dict(stage.named_parameters()) for stage in stages]
    names = [fqn for params in held for fqn in params]
    assert sorted(names) == sorted(dict(model.named_parameters()))  # once each
    for params in held:  # the model's own parameters: trained in place
        for fqn, p in params.items():
            assert p is model.get_parameter(fqn)


def test_a_tied_parameter_is_owned_by_its_first_stage_and_replicated_later():
    model, captured, ctx, _ = _captured("gpt2")
    stages = pipeline_stages(captured.gm, CUTS["gpt2"], ctx)
    tied = "transformer.wte.weight"  # also lm_head.weight
    assert pipeline_info(stages[1]).shared == (SharedParameter(tied, 0, (2,)),)
    assert stages[0].get_parameter(tied) is model.get_parameter(tied)
    replica = stages[2].get_buffer(tied)
    assert tied not in dict(stages[2].named_parameters())
    assert replica.requires_grad and torch.equal(replica, model.get_parameter(tied))


def test_operators_keep_their_analysis_meta_and_stage():
    _, captured, ctx, _ = _captured("llama")
    cuts = CUTS["llama"]
    stages = pipeline_stages(captured.gm, cuts, ctx)
    for k, stage in enumerate(stages):
        stage_of = assign_stages(stage.graph, cuts)  # by the module paths carried along
        for node in stage.graph.nodes:
            PARAMS.get(node)  # every node, inputs and attributes included
            if node.op == "call_function" and PARAMS.get(node):
                assert stage_of[node] == k, (k, node.name, MODULE_PATH.get(node))


def test_split_stages_keeps_this_ranks_stages():
    _, captured, ctx, _ = _captured("llama")
    cuts = ("model.layers.1", "model.layers.2", "model.layers.3")  # pp=2 × 2 virtual
    target = RankTarget(SimpleNamespace(stage_cuts=cuts), _PipelineRank(1, 2))
    ctx = dataclasses.replace(ctx, target=target)
    stages, ids = split_stages(captured.gm, ctx)
    assert ids == [1, 3]
    assert [pipeline_info(s).stage for s in stages] == [1, 3]


def test_a_cut_naming_no_module_is_an_error():
    _, captured, ctx, _ = _captured("llama")
    with pytest.raises(PlanError, match="model.layers.9"):
        pipeline_stages(captured.gm, ("model.layers.9",), ctx)


class _PipelineRank:
    """This rank's coordinate on the pp axis, as MeshGroups gives it."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self, axis: Axis) -> int:
        assert axis is Axis.PP
        return self._rank

    def size(self, axis: Axis) -> int:
        assert axis is Axis.PP
        return self._size
