"""A learned attention bias (T5's relative positions) reaches scaled_dot_product_attention
as a mask that needs a gradient: the fused kernels cannot differentiate it, so planning
measures the math path the dispatcher runs for it, and training matches one device
(dp=2, tp=2; fp32, 3 AdamW steps, Gloo)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import autopart
from autopart.testing import run_world
from tests.models import assert_matches, make_optimizer, train_reference

STEPS = 3
CASES = [{"dp": 2}, {"tp": 2}]


class _Seq2Seq(torch.nn.Module):
    """T5 taking (encoder ids, decoder ids) positionally, as train_step passes them."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, decoder_ids: torch.Tensor):
        return self.model(input_ids=ids, decoder_input_ids=decoder_ids)


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(
        vocab_size=128,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        dropout_rate=0.0,
        use_cache=False,
        decoder_start_token_id=0,
    )
    return _Seq2Seq(T5ForConditionalGeneration(config))


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
            _t5(),
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


def test_a_learned_attention_bias_trains_like_one_device():
    batch = _batch()
    ids, decoder_ids, target = batch
    reference = train_reference(_t5(), "adamw", STEPS, (ids, decoder_ids), target, _loss)
    assert any(p.requires_grad for n, p in _t5().named_parameters() if "relative_attention" in n)
    for results in run_world(_train, 2, batch):
        for pins in CASES:
            assert_matches(results[tuple(pins.items())], reference)
