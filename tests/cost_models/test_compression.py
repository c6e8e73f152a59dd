"""What gradient compression sends, as the cost model prices it."""

from __future__ import annotations

import pytest
import torch

import autopart
from autopart.api import captured_for_planning
from autopart.cost_models.compression import gradient_fraction
from autopart.solver import Pins, make_plan
from tests.models import tiny_gpt2, token_batch

SHAPES = [torch.Size([64, 32]), torch.Size([32, 64]), torch.Size([64])]  # 4160 elements


def test_bf16_sends_half_of_fp32():
    assert gradient_fraction("bf16", SHAPES, 4) == 0.5
    assert gradient_fraction(None, SHAPES, 4) == 1.0


def test_powersgd_sends_its_factors_and_the_vectors_whole():
    # rank 4: (64 + 32) × 4 for each matrix, the 64-vector whole
    sent = 2 * 96 * 4 + 64
    assert gradient_fraction("powersgd:rank=4", SHAPES, 4) == pytest.approx(sent / 4160)
    # rank 40 exceeds the matrices' smaller side: everything whole
    assert gradient_fraction("powersgd:rank=40", SHAPES, 4) == 1.0


def test_the_step_prices_the_smaller_all_reduce():
    ids, _ = token_batch(64)
    mesh = autopart.Mesh.cluster("a100-80g", 4, 8)
    pins = {"dp": 32, "tp": 1, "pp": 1, "zero": 0, "microbatches": 1}
    captured = captured_for_planning(tiny_gpt2(), (ids,), repeated_once=True)  # once for all
    sync = {
        c: make_plan(captured, mesh, Pins.of(grad_compression=c, **pins)).predicted
        for c in (None, "bf16", "powersgd:rank=4")
    }
    assert sync["powersgd:rank=4"].exposed_comm_s < sync["bf16"].exposed_comm_s
    assert sync["bf16"].exposed_comm_s < sync[None].exposed_comm_s
    assert sync["bf16"].compute_s == sync[None].compute_s
