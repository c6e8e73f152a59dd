"""Ring attention over the mirrored sequence layout against whole attention: outputs and
the gradients of q, k and v on every rank's chunks, causal and not, on 2 and 4 Gloo
ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopart.ops.context_parallel import cp_gather, cp_shard, mirrored_chunks, ring_attention
from autopart.testing import run_world


def _whole(causal: bool):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3)
    g = torch.randn_like(out)
    out.backward(g)
    return q, k, v, out, g


def _ring(causal: bool) -> dict:
    q, k, v, out, g = _whole(causal)
    group = dist.group.WORLD.group_name
    parts = [cp_shard(t.detach(), 2, group).requires_grad_() for t in (q, k, v)]
    local = ring_attention(*parts, group, is_causal=causal, scale=0.3)
    local.backward(cp_shard(g, 2, group))
    return {
        "out": (local - cp_shard(out.detach(), 2, group)).abs().max().item(),
        "grads": max(
            (p.grad - cp_shard(t.grad, 2, group)).abs().max().item()
            for p, t in zip(parts, (q, k, v))
        ),
        "round_trip": (cp_gather(parts[0].detach(), 2, group) - q.detach()).abs().max().item(),
    }


def _both() -> dict:
    return {causal: _ring(causal) for causal in (True, False)}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_matches_whole_attention(world):
    for rank_result in run_world(_both, world):
        for causal, r in rank_result.items():
            assert r["out"] < 1e-12 and r["grads"] < 1e-12 and r["round_trip"] == 0, (causal, r)


def test_mirrored_chunks_balance_causal_work():
    """Rank r's chunks r and 2cp-1-r: every rank holds chunks summing to 2cp-1, so each
    attends over the same number of causal (query, key) chunk pairs."""
    for cp in (2, 4, 8):
        held = [mirrored_chunks(r, cp) for r in range(cp)]
        assert sorted(c for pair in held for c in pair) == list(range(2 * cp))
        assert {sum(pair) for pair in held} == {2 * cp - 1}
