"""A replacement's output in the captured value's dim order (`ops.layout`): the order is
read off the capture, and a tensor laid out in it takes the views traced against it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autopart.capture import capture
from autopart.ops.aten import op_name
from autopart.ops.layout import captured_dim_order, empty_in_order, in_dim_order

FUSED_KERNEL = (0, 2, 1, 3)  # [batch, heads, seq, head_dim] laid out as [b, s, h, d]


class _FusedAttention(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = (t.view(b, s, 2, w // 6).transpose(1, 2) for t in x.split(w // 3, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).contiguous().view(b, s, w // 3)


def test_the_captured_attention_is_laid_out_as_the_fused_kernel_returns_it():
    captured = capture(_FusedAttention(), (torch.randn(2, 8, 48),))
    (node,) = [n for n in captured.gm.graph.nodes if op_name(n) == "scaled_dot_product_attention"]
    assert captured_dim_order(node) == FUSED_KERNEL
    # torch.export dropped the no-op `.contiguous()`: the view reads the kernel's layout.
    assert not [n for n in captured.gm.graph.nodes if "clone" in str(n.target)]


def test_a_tensor_in_the_captured_order_takes_the_views_traced_against_it():
    out = empty_in_order((2, 4, 8, 16), FUSED_KERNEL, torch.empty(0), torch.float32)
    assert out.shape == (2, 4, 8, 16) and out.dim_order() == FUSED_KERNEL
    out.transpose(1, 2).view(2, 8, 64)  # raises on a contiguous [b, h, s, d] tensor
    x = torch.randn(2, 4, 8, 16)
    laid = in_dim_order(x, FUSED_KERNEL)
    assert torch.equal(laid, x) and laid.dim_order() == FUSED_KERNEL
    assert in_dim_order(laid, FUSED_KERNEL) is laid and in_dim_order(x, None) is x
