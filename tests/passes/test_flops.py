"""FLOPs: exact for contractions and convolutions, symbolic in the dynamic dims, and a
GPT's total within 2% of the analytic 2·params·tokens + attention."""

from __future__ import annotations

import sympy
import torch
from torch import nn
from torch.export import Dim

from autopart.capture import capture
from autopart.ops.aten import op_name
from autopart.passes import FLOPS, analyze, total_flops
from tests.models import ConvNet


def _analyzed(model, *inputs, **kw):
    captured = capture(model, inputs, **kw)
    analyze(captured.gm, captured.context())
    return captured


def _flops_by_op(gm, name):
    return [FLOPS.get(n) for n in gm.graph.nodes if op_name(n, gm) == name]


def test_linear_and_bmm_are_exact():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(32, 48)

        def forward(self, x):
            y = self.fc(x)  # (4, 10, 48)
            return torch.bmm(y, y.transpose(1, 2))  # (4, 10, 10), K = 48

    gm = _analyzed(M(), torch.randn(4, 10, 32), dynamic_batch=False).gm
    assert _flops_by_op(gm, "linear") == [2 * 4 * 10 * 48 * 32 + 4 * 10 * 48]
    assert _flops_by_op(gm, "bmm") == [2 * 4 * 10 * 10 * 48]


def test_convolution_is_exact():
    gm = _analyzed(ConvNet(), torch.randn(2, 3, 16, 16), dynamic_batch=False).gm
    conv1, conv2 = _flops_by_op(gm, "convolution")
    assert conv1 == 2 * (2 * 8 * 16 * 16) * 3 * 9 + 2 * 8 * 16 * 16
    assert conv2 == 2 * (2 * 16 * 8 * 8) * 8 * 9 + 2 * 16 * 8 * 8


def test_flops_are_expressions_of_named_dims():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(
        GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128, vocab_size=256, use_cache=False)
    )
    ids = torch.zeros(2, 16, dtype=torch.long)
    captured = _analyzed(model, ids, dynamic_shapes=({0: Dim("batch"), 1: Dim("seq", max=128)},))
    total = total_flops(captured.gm)
    batch, seq = captured.dims["batch"], captured.dims["seq"]
    assert total.free_symbols == {batch, seq}
    # Evaluating the expression for another shape gives that shape's count, no recapture.
    other = _analyzed(model, torch.zeros(3, 40, dtype=torch.long), dynamic_batch=False)
    assert total.subs({batch: 3, seq: 40}) == total_flops(other.gm)


def test_gpt_forward_flops_match_the_analytic_count():
    from transformers import GPT2Config, GPT2LMHeadModel

    h, layers, heads, vocab, seq, batch = 768, 12, 12, 50257, 1024, 2
    config = GPT2Config(
        n_embd=h, n_layer=layers, n_head=heads, vocab_size=vocab, n_positions=seq, use_cache=False
    )
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    flops = total_flops(_analyzed(model, ids, dynamic_batch=False).gm)
    params = sum(p.numel() for p in model.parameters())  # the tied lm_head counted once
    tokens = batch * seq
    attention = 2 * 2 * batch * seq * seq * h * layers  # QK^T and AV, full score matrix
    analytic = 2 * params * tokens + attention
    assert isinstance(flops, sympy.Integer)
    assert abs(int(flops) - analytic) / analytic < 0.02
