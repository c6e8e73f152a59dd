"""Planning 16-bit parameters (`precision="bf16-params"`): what the plan holds and moves,
priced against autocast's (`"bf16-mixed"`) on the same model and mesh, on the meta
device."""

from __future__ import annotations

import pytest
import torch

import autopart
from autopart.plan import Plan, PlanError


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=4096,
        max_position_embeddings=1024,
        use_cache=False,
    )
    with autopart.init_empty_weights():
        return LlamaForCausalLM(config)


IDS = torch.zeros(16, 1024, dtype=torch.long, device="meta")
MESH = autopart.Mesh.cluster("h100-80g", nodes=1, per_node=8)


def _plan(precision: str, **pins: object) -> Plan:
    return autopart.plan(_llama(), MESH, (IDS,), precision=precision, dp=8, zero=3, **pins)


def test_holds_half_the_weights_and_the_masters_with_the_optimizer() -> None:
    mixed, params = _plan("bf16-mixed"), _plan("bf16-params")
    assert mixed.predicted is not None and params.predicted is not None
    held, autocast = params.predicted.memory, mixed.predicted.memory
    assert held["parameters"] == pytest.approx(autocast["parameters"] / 2)
    assert held["optimizer"] == pytest.approx(autocast["optimizer"] * 12 / 8)
    assert held["gradients"] == pytest.approx(autocast["gradients"])
    # The graph captured in bf16 saves bf16 activations and pays no autocast casts.
    assert held["activations"] < autocast["activations"]
    assert params.predicted.step_time_s < mixed.predicted.step_time_s
    assert "precision='bf16-params'" in params.explain()


def test_gradients_reduced_in_bf16_are_priced_cheaper() -> None:
    fp32, bf16 = _plan("bf16-params"), _plan("bf16-params", reduce_dtype="bf16")
    assert fp32.predicted is not None and bf16.predicted is not None
    assert bf16.reduce_dtype == "bf16"
    assert bf16.predicted.step_time_s < fp32.predicted.step_time_s


def test_plan_round_trips(tmp_path) -> None:
    plan = _plan("bf16-params", reduce_dtype="bf16")
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert (loaded.precision, loaded.reduce_dtype) == ("bf16-params", "bf16")


@pytest.mark.parametrize(
    ("pins", "says"),
    [
        ({"dp": 8, "zero": 0}, "zero=1, 2 or 3"),
        ({"dp": 8, "zero": 3, "offload": True}, "does not combine with offload"),
        ({"dp": 8, "zero": 3, "reduce_dtype": "fp16"}, "reduce_dtype must be one of"),
    ],
)
def test_refusals_say_what_would_run(pins: dict, says: str) -> None:
    with pytest.raises(PlanError, match=says):
        autopart.plan(_llama(), MESH, (IDS,), precision="bf16-params", **pins)


def test_reduce_dtype_needs_sixteen_bit_parameters() -> None:
    with pytest.raises(PlanError, match="is for 16-bit parameters"):
        autopart.plan(_llama(), MESH, (IDS,), precision="bf16-mixed", reduce_dtype="bf16")


def test_free_plan_never_picks_zero0_over_replicas() -> None:
    plan = autopart.plan(_llama(), MESH, (IDS,), precision="bf16-params")
    assert plan.dp * plan.ep == 1 or plan.zero >= 1
