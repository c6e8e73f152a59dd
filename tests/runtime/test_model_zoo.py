"""A few of the model zoo's models under its four pins (DP2, TP2, ZeRO-3, PP2 on 2 Gloo
processes) against one device: a speech encoder-decoder, `torch.nn.Transformer`, an MoE
decoder with a shared expert, and a BatchNorm CNN, whose pipeline of microbatches is
refused. `benchmarks/model_zoo.py` runs all of them."""

from __future__ import annotations

import pytest

from tests.zoo import PINS, judge_model


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["whisper", "nn_transformer", "qwen2_moe"])
def test_a_zoo_model_trains_like_one_device_under_every_pin(model_name):
    verdicts = judge_model(model_name, list(PINS))
    assert all(v["status"] == "pass" for v in verdicts.values()), verdicts


@pytest.mark.slow
def test_a_batchnorm_cnn_trains_where_the_batch_splits_over_replicas_not_microbatches():
    """Its batch norms take the whole batch's statistics over the replicas
    (passes/batch_norm.py); a replica's microbatches would normalize apart."""
    verdicts = judge_model("cnn_batchnorm", list(PINS))
    pp2 = verdicts.pop("pp2")  # 2 microbatches
    assert pp2["status"] == "refused", pp2
    assert "microbatches=2 would split each replica's batch" in pp2["reason"], pp2
    assert all(v["status"] == "pass" for v in verdicts.values()), verdicts
