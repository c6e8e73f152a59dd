"""A few of the model zoo's models under its pins (DP2, TP2, ZeRO-3, PP2, and CP2 and EP2
where a model has them, on 2 Gloo processes) against one device: a speech
encoder-decoder, `torch.nn.Transformer`, an MoE decoder with a shared expert, and the
models that mix their batch (BatchNorm CNNs, CLIP), whose pin that splits a replica's
batch into microbatches is refused; an MoE decoder under CP2 and EP2 in the quick suite;
and the models context parallelism refuses, saying why.
`benchmarks/model_zoo.py` runs all of them."""

from __future__ import annotations

import pytest

from tests.zoo import judge_model, pins_of


@pytest.mark.slow  # ep and cp are each checked quick
def test_a_mixture_of_experts_trains_like_one_device_over_the_sequence_and_the_experts():
    verdicts = judge_model("mixtral", ["cp2", "ep2"])
    assert all(v["status"] == "pass" for v in verdicts.values()), verdicts


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["whisper", "nn_transformer", "qwen2_moe"])
def test_a_zoo_model_trains_like_one_device_under_every_pin(model_name):
    verdicts = judge_model(model_name, pins_of(model_name))
    assert all(v["status"] == "pass" for v in verdicts.values()), verdicts


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_name",
    ["cnn_batchnorm", "resnet", "mobilenet_v2", "efficientnet", "two_tower", "clip"],
)
def test_a_model_that_mixes_its_batch_is_refused_only_where_microbatches_split_it(model_name):
    """BatchNorm CNNs (Hugging Face's ResNet, MobileNetV2 and EfficientNet among them)
    take the whole batch's statistics over dp replicas, and CLIP-style models gather
    their embeddings over them (dp2, zero3); tp2 keeps the batch whole. A replica's
    microbatches (pp2's 2) would each see their own part: refused, saying why."""
    verdicts = judge_model(model_name, ["dp2", "tp2", "zero3", "pp2"])
    pp2 = verdicts.pop("pp2")
    assert all(v["status"] == "pass" for v in verdicts.values()), verdicts
    assert pp2["status"] == "refused", pp2
    assert "microbatches=2 would split each replica's batch" in pp2["reason"], pp2


# Context parallelism shards token inputs and runs scaled_dot_product_attention as a
# ring: a model that attends over patches or audio frames, or by its own matmuls, is
# refused with the reason.
CP_REFUSALS = {
    "vit": "has no token input",
    "wav2vec2": "has no token input",
    "deberta_v2": "does not call scaled_dot_product_attention",
}


@pytest.mark.slow
@pytest.mark.parametrize("model_name", list(CP_REFUSALS))
def test_context_parallelism_refuses_what_it_cannot_split_saying_why(model_name):
    (verdict,) = judge_model(model_name, ["cp2"]).values()
    assert verdict["status"] == "refused", verdict
    assert CP_REFUSALS[model_name] in verdict["reason"], verdict
