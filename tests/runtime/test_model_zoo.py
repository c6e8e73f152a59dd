"""A few of the model zoo's models under its four pins (DP2, TP2, ZeRO-3, PP2 on 2 Gloo
processes) against one device: a speech encoder-decoder, `torch.nn.Transformer`, an MoE
decoder with a shared expert, and a BatchNorm CNN, whose batch-splitting pins are
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
def test_a_batchnorm_cnn_is_refused_where_the_batch_splits_and_trains_under_tp():
    verdicts = judge_model("cnn_batchnorm", list(PINS))
    assert verdicts.pop("tp2")["status"] == "pass"
    for pin, v in verdicts.items():  # dp2, zero3 and pp2 (2 microbatches) split the batch
        assert v["status"] == "refused", (pin, v)
        assert "mixes the examples of a batch: batch_norm" in v["reason"], (pin, v)
