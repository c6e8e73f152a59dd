"""The other analyses: parameters read, traffic, saved-for-backward bytes, repeated
blocks, loud getters and the pass runner."""

from __future__ import annotations

import pytest
import sympy
import torch
from torch import nn

from autopart.capture import capture
from autopart.ops.aten import op_name
from autopart.passes import (
    ANALYSIS_PASSES,
    BLOCK,
    FLOPS,
    PARAMS,
    SAVED_BYTES,
    TRAFFIC,
    AnalysisMissing,
    analyze,
    run_passes,
)
from tests.models import tiny_gpt2, tiny_llama, token_batch


def _analyzed(model, *inputs):
    captured = capture(model, inputs, dynamic_batch=False)
    analyze(captured.gm, captured.context())
    return captured.gm


def _node(gm, name):
    return next(n for n in gm.graph.nodes if op_name(n, gm) == name)


class TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 8, bias=False)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def test_params_traffic_and_saved_bytes_of_a_small_mlp():
    gm = _analyzed(TwoLinears(), torch.randn(4, 16))
    linears = [n for n in gm.graph.nodes if op_name(n, gm) == "linear"]
    assert [PARAMS.get(n) for n in linears] == [("a.bias", "a.weight"), ("b.weight",)]
    traffic = TRAFFIC.get(linears[0])
    assert traffic.read == 4 * (4 * 16 + 32 * 16 + 32)
    assert traffic.written == 4 * 4 * 32
    # linear a saves its input x; tanh saves its output; linear b saves tanh's output
    # (the same storage, counted once). Weights are not activations.
    saved = sympy.Add(*(SAVED_BYTES.get(n) for n in gm.graph.nodes))
    assert saved == 4 * (4 * 16) + 4 * (4 * 32)


def test_tied_weights_are_read_under_one_name():
    gm = _analyzed(tiny_gpt2(), token_batch(2)[0])
    readers = {p for n in gm.graph.nodes for p in PARAMS.get(n)}
    assert "transformer.wte.weight" in readers and "lm_head.weight" not in readers


def test_transformer_layers_share_one_block_id():
    gm = _analyzed(tiny_llama(layers=3), token_batch(2)[0])
    blocks = {BLOCK.get(n) for n in gm.graph.nodes} - {None}
    assert {b.instance for b in blocks} == {f"model.layers.{i}" for i in range(3)}
    assert len({b.block_id for b in blocks}) == 1
    embedding = _node(gm, "embedding")
    assert BLOCK.get(embedding) is None


def test_blocks_with_different_structure_get_different_ids():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 16)])

        def forward(self, x):
            return self.layers[2](self.layers[1](self.layers[0](x)))

    gm = _analyzed(Mixed(), torch.randn(2, 8))
    ids = {BLOCK.get(n).instance: BLOCK.get(n).block_id for n in gm.graph.nodes if BLOCK.get(n)}
    # The main stack's layers are all blocks (pipeline cuts may fall between any two);
    # the two identical copies share one id, the odd one has its own.
    assert set(ids) == {"layers.0", "layers.1", "layers.2"}
    assert ids["layers.0"] == ids["layers.1"] != ids["layers.2"]


def test_getters_fail_loudly_and_runner_skips_disabled_passes():
    captured = capture(TwoLinears(), (torch.randn(4, 16),))
    node = next(n for n in captured.gm.graph.nodes if n.op == "call_function")
    with pytest.raises(AnalysisMissing, match="run flops_pass first"):
        FLOPS.get(node)
    ctx = captured.context()
    ctx.disabled = frozenset({"saved_for_backward_pass"})
    run_passes(captured.gm, ctx, ANALYSIS_PASSES)
    assert FLOPS.has(node) and not SAVED_BYTES.has(node)
    assert "flops_pass" in ctx.timings and "saved_for_backward_pass" not in ctx.timings
