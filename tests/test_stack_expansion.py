"""A capture of the shortened stack, expanded, is the whole model's capture: the same
graph, and plans made from it equal the plans made from the whole capture."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import fx, nn

import autopart
from autopart.api import captured_for_planning
from autopart.capture import capture
from autopart.passes import MODULE_PATH, SHAPE, analyze
from autopart.plan import PlanError
from autopart.repeated_stack import main_stack
from autopart.solver import Pins, make_plan
from autopart.stack_expansion import capture_repeated_once
from tests.models import tiny_gpt2, tiny_llama, token_batch
from tests.zoo import MODELS

LAYERS = 6
_LAYER_COUNTS = (
    "num_hidden_layers",
    "n_layer",
    "num_layers",
    "num_decoder_layers",
    "encoder_layers",
    "decoder_layers",
)


def _deeper(model: nn.Module, layers: int = LAYERS) -> nn.Module | None:
    """`model` built again from its Hugging Face config with `layers` layers in each
    stack; None where it has no such config."""
    config = copy.deepcopy(getattr(model, "config", None))
    if config is None or not any(hasattr(config, k) for k in _LAYER_COUNTS):
        return None
    for key in _LAYER_COUNTS:
        if hasattr(config, key):
            setattr(config, key, layers)
    if getattr(config, "layer_types", None):
        config.layer_types = (list(config.layer_types) * layers)[:layers]
    torch.manual_seed(0)
    try:
        return type(model)(config)
    except (IndexError, ValueError):  # per-stage lists of another length (ConvNeXt's)
        return None


def _structure(gm: fx.GraphModule) -> list[tuple]:
    """Each node's operator, inputs by position, module path and shape."""
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    return [
        (
            n.op,
            str(n.target),
            [position[a] for a in n.all_input_nodes],
            MODULE_PATH.get(n),
            str(SHAPE.get(n, None)),
        )
        for n in gm.graph.nodes
    ]


@pytest.mark.parametrize(
    "build, device",
    [
        (tiny_llama, "meta"),
        pytest.param(tiny_gpt2, "cpu", marks=pytest.mark.slow),
        pytest.param(tiny_llama, "cpu", marks=pytest.mark.slow),
        pytest.param(tiny_gpt2, "meta", marks=pytest.mark.slow),
    ],
)
def test_the_expanded_graph_is_the_whole_capture(build, device):
    with torch.device(device):
        model = build(layers=LAYERS)
    ids = token_batch(4)[0].to(device)
    whole = capture(model, (ids,), dynamic_batch=device != "meta")
    built = capture_repeated_once(model, (ids,), dynamic_batch=device != "meta")
    for c in (whole, built):
        analyze(c.gm, c.context())
    assert _structure(built.gm) == _structure(whole.gm)
    assert built.fingerprint == whole.fingerprint
    assert built.dims == whole.dims and built.dim_ranges == whole.dim_ranges
    # The traced stack was cut, and is whole again after.
    assert len(model.get_submodule(main_stack(model).path)) == LAYERS


def test_a_stack_of_unlike_blocks_is_captured_whole():
    model = tiny_llama(layers=LAYERS)
    model.model.layers[4].mlp.act_fn = nn.Tanh()  # one block differs from the rest
    assert main_stack(model) is None


def _same(a: Any, b: Any, where: str = "plan") -> None:
    """Plans' JSON alike: floats to 0.1 %, everything else exactly."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-12), where
    else:
        assert a == b, where


def _plan_both_ways(model: nn.Module, inputs: tuple, mesh: autopart.Mesh, **pins: Any) -> None:
    outcomes = []
    for once in (False, True):
        captured = captured_for_planning(model, inputs, repeated_once=once)
        try:
            outcomes.append(make_plan(captured, mesh, Pins.of(**pins)).to_json())
        except PlanError as e:
            outcomes.append(str(e))
    _same(outcomes[0], outcomes[1])


ZOO_PINS: list[dict[str, Any]] = [{}, {"tp": 2, "pp": 2, "microbatches": 4}]
# One model of each kind of stack (decoders with and without a fused projection,
# encoders, vision and speech), each planned from two captures: with the slow sweeps,
# since the quick suite checks the expanded graph itself.
STACKS = ("llama", "gpt2", "mistral", "qwen3", "gpt_neox", "bert", "vit", "wav2vec2")


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    STACKS,
)
def test_a_plan_from_the_shortened_capture_is_the_whole_captures(name):
    case = MODELS[name]
    model = _deeper(case.model())
    if model is None or main_stack(model) is None:
        pytest.skip("no repeated stack to shorten")
    inputs, _ = case.batch()
    mesh = autopart.Mesh.cluster("a10-24g", nodes=1, per_node=8)
    for pins in ZOO_PINS:
        _plan_both_ways(model, inputs, mesh, **pins)


def _on_meta(build: Any) -> nn.Module:
    with torch.device("meta"):
        return build()


BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


@pytest.mark.slow
@pytest.mark.parametrize("case", ["llama3-8b", "gpt-1t"])
def test_plan_speed_shapes_plan_alike(case, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from plan_speed import CASES

    shape = CASES[case]
    model = _on_meta(shape.build)
    ids = torch.zeros(shape.batch, shape.seq, dtype=torch.long, device="meta")
    mesh = autopart.Mesh.cluster(shape.device, nodes=shape.nodes, per_node=8)
    _plan_both_ways(model, (ids,), mesh, precision="bf16-mixed")


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    ["gpt-18.4b", "gpt-1008b", "mt-nlg-530b", "bloom-176b"],
)
def test_published_runs_plan_alike(case, monkeypatch):
    """The published runs' configurations, pinned as `benchmarks/plan_quality.py` pins
    them: the pipeline's cuts by module path, the layout, the predictions."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from harness import pinned_as_published
    from plan_quality import CONFIGS

    run = CONFIGS[case]
    model = _on_meta(run.build)
    ids = torch.zeros(run.batch, run.seq, dtype=torch.long, device="meta")
    mesh = autopart.Mesh.cluster(run.device, nodes=run.gpus // 8, per_node=8)
    pins = pinned_as_published(run.experts, run.gpus, run.batch, run.microbatch_size, run.precision)
    _plan_both_ways(model, (ids,), mesh, **pins)
