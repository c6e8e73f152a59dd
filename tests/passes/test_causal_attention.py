"""Explicit causal masks become `is_causal=True`; data-dependent masks stay."""

from __future__ import annotations

import torch
from torch import nn

from autopart.capture import capture
from autopart.ops.aten import op_name
from autopart.passes import analyze
from autopart.passes.causal_attention import causal_attention_pass
from tests.models import tiny_gpt2, tiny_llama, token_batch


def _attention_calls(gm):
    return [n for n in gm.graph.nodes if op_name(n, gm) == "scaled_dot_product_attention"]


def test_decoder_masks_become_is_causal_and_outputs_stay():
    for build in (tiny_llama, tiny_gpt2):
        model = build()
        ids = token_batch(4)[0]
        captured = capture(model, (ids,))
        assert all(len(n.args) > 3 for n in _attention_calls(captured.gm))  # explicit masks
        analyze(captured.gm, captured.context())
        gm = causal_attention_pass(captured.gm, captured.context(example_args=(ids,)))
        calls = _attention_calls(gm)
        assert calls and all(n.kwargs.get("is_causal") and len(n.args) == 3 for n in calls)
        torch.testing.assert_close(gm(ids).logits, model(ids).logits)


class PaddedAttention(nn.Module):
    """A mask from a padding input depends on the data: it must stay."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x, keep):
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        mask = keep[:, None, None, :] & torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        return nn.functional.scaled_dot_product_attention(q, k, v, mask)


def test_a_padding_mask_is_kept():
    x = torch.randn(2, 5, 8)
    keep = torch.ones(2, 5, dtype=torch.bool)
    captured = capture(PaddedAttention(), (x, keep), dynamic_batch=False)
    analyze(captured.gm, captured.context())
    gm = causal_attention_pass(captured.gm, captured.context(example_args=(x, keep)))
    assert all(len(n.args) > 3 for n in _attention_calls(gm))
