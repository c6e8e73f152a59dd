"""Per-rank memory: the ZeRO paper's figures, schedules' microbatches in flight,
recomputation and the allocator allowance."""

from __future__ import annotations

import pytest

from autopart.cost_models.memory import (
    HALF_WEIGHTS,
    STATE_BYTES,
    Activations,
    MemoryModel,
    in_flight_microbatches,
    model_state_bytes,
    total,
)

GB = 1e9


@pytest.mark.parametrize(("zero", "expected_gb"), [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_example(zero, expected_gb):
    # Rajbhandari et al. 2020, figure 1: 7.5B parameters, N_d = 64, mixed-precision Adam.
    states = model_state_bytes(7.5e9, dp=64, zero=zero, per_param=HALF_WEIGHTS)
    assert sum(states.values()) / GB == pytest.approx(expected_gb, abs=0.05)


def test_breakdown_without_activations_is_the_model_states():
    # The runtime's mixed precision is autocast: weights and gradients stay fp32.
    model = MemoryModel("fp16-mixed", allocator_fraction=0.0)
    parts = model.breakdown(7.5e9, dp=64, zero=3)
    assert parts["parameters"] == parts["gradients"] == round(4 * 7.5e9 / 64)
    assert parts["optimizer"] == round(8 * 7.5e9 / 64)
    assert parts["activations"] == 0


def test_fp32_adam_keeps_sixteen_bytes_per_parameter():
    states = model_state_bytes(1e9, dp=8, zero=0, per_param=STATE_BYTES["fp32"])
    assert states == {"parameters": 4e9, "gradients": 4e9, "optimizer": 8e9}


def test_allocator_allowance_is_a_fraction_of_the_rest():
    parts = MemoryModel("fp32", allocator_fraction=0.1).breakdown(1e9, activations=4e9)
    rest = total(parts) - parts["allocator"]
    assert parts["allocator"] == pytest.approx(0.1 * rest, rel=1e-9)
    assert set(parts) == {
        "parameters",
        "gradients",
        "optimizer",
        "activations",
        "output_gradients",
        "buffers",
        "allocator",
    }


def test_zero3_holds_two_gathered_blocks_and_a_bucket():
    model = MemoryModel("bf16-mixed", bucket_bytes=100, allocator_fraction=0.0)
    parts = model.breakdown(1e6, dp=4, zero=3, gathered_params=1000)
    assert parts["buffers"] == 2 * 1000 * 4 + 100  # gathered fp32 weights, two blocks


@pytest.mark.parametrize(
    ("schedule", "stage", "expected"),
    [("gpipe", 0, 8), ("gpipe", 3, 8), ("1f1b", 0, 4), ("1f1b", 3, 1), (None, 0, 1)],
)
def test_microbatches_in_flight(schedule, stage, expected):
    assert in_flight_microbatches(schedule, microbatches=8, stages=4, stage=stage) == expected


def test_interleaved_first_rank_holds_about_p_times_one_plus_one_over_v():
    # Megatron-LM's warm-up: 2(p − 1) + (v − 1)p chunk-forwards, plus the one running.
    p, v = 4, 2
    in_flight = in_flight_microbatches("interleaved-1f1b", 16, p, 0, v)
    assert in_flight == (2 * (p - 1) + (v - 1) * p + 1) / v
    assert in_flight_microbatches("interleaved-1f1b", 16, p, p - 1, v) == (v - 1) * p / v + 0.5


def test_recomputation_keeps_block_inputs_and_one_block():
    layers, saved, block_input, in_flight = 8, 100.0, 10.0, 4
    plain = Activations(kept=layers * saved).bytes(in_flight)
    recomputed = Activations(
        recomputed_inputs=layers * block_input, largest_recomputed=saved
    ).bytes(in_flight)
    assert plain == in_flight * layers * saved
    assert recomputed == in_flight * layers * block_input + saved


def test_a_bucket_holds_at_most_all_the_gradients():
    model = MemoryModel("fp32", allocator_fraction=0.0)
    assert model.breakdown(1000, dp=4, zero=2)["buffers"] == 4 * 1000


def test_the_loss_rank_holds_two_output_sized_gradients():
    model = MemoryModel("fp32", allocator_fraction=0.0)
    with_loss = model.breakdown(1e6, activations=5e6, output_bytes=512 * 1024)
    without = model.breakdown(1e6, activations=5e6)
    assert with_loss["output_gradients"] == 2 * 512 * 1024
    assert total(with_loss) - total(without) == 2 * 512 * 1024
