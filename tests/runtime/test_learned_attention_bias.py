"""A learned attention bias (T5's relative positions) reaches scaled_dot_product_attention
as a mask that needs a gradient: the fused kernels cannot differentiate it, so planning
measures the math path the dispatcher runs for it, and training matches one device
(dp=2, tp=2; fp32, 3 AdamW steps, Gloo)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import autopart
from autopart.testing import run_world
from tests.models import assert_matches, make_optimizer, tiny_t5, train_reference

STEPS = 3
CASES = [{"dp": 2}, {"tp": 2}]


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (4, 16), generator=g)
    decoder_ids = torch.randint(0, 128, (4, 8), generator=g)
    target = torch.randint(0, 128, (4, 8), generator=g)
    return ids, decoder_ids, target


def _loss(output, target):
    return F.cross_entropy(output.logits.flatten(0, 1), target.flatten())


def _train(batch) -> dict:
    ids, decoder_ids, target = batch
    out = {}
    for pins in CASES:
        pm = autopart.parallelize(
            tiny_t5(),
            autopart.Mesh.local(),
            (ids, decoder_ids),
            loss_fn=_loss,
            optimizer=make_optimizer("adamw"),
            **pins,
        )
        losses = [pm.train_step((ids, decoder_ids), target).item() for _ in range(STEPS)]
        out[tuple(pins.items())] = {"losses": losses, "params": pm.full_state_dict()}
        pm.close()
    return out


@pytest.mark.slow  # a 2-rank world of T5 under tp
def test_a_learned_attention_bias_trains_like_one_device():
    batch = _batch()
    ids, decoder_ids, target = batch
    reference = train_reference(tiny_t5(), "adamw", STEPS, (ids, decoder_ids), target, _loss)
    learned = [p for n, p in tiny_t5().named_parameters() if "relative_attention" in n]
    assert any(p.requires_grad for p in learned)
    for results in run_world(_train, 2, batch):
        for pins in CASES:
            assert_matches(results[tuple(pins.items())], reference)
