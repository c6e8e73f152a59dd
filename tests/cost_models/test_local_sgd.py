"""What local SGD's parameter averaging costs a step, as the cost model prices it."""

from __future__ import annotations

import pytest

import autopart
from autopart.api import captured_for_planning
from autopart.solver import Pins, make_plan
from tests.models import tiny_gpt2, token_batch


def test_averaging_every_h_steps_costs_one_parameter_all_reduce_per_h_steps():
    ids, _ = token_batch(64)
    mesh = autopart.Mesh.cluster("a100-80g", 4, 8)
    pins = {"dp": 32, "tp": 1, "pp": 1, "zero": 0, "microbatches": 1}
    captured = captured_for_planning(tiny_gpt2(), (ids,), repeated_once=True)  # once for all
    exposed = {
        h: make_plan(captured, mesh, Pins.of(sync_every=h, **pins)).predicted
        for h in (None, 1, 2, 4)
    }
    # The same all-reduce, amortized over h steps: 1 - 1/4 of it is 3 × (1/2 - 1/4).
    saved_by_4 = exposed[1].exposed_comm_s - exposed[4].exposed_comm_s
    saved_from_2 = exposed[2].exposed_comm_s - exposed[4].exposed_comm_s
    assert saved_from_2 > 0
    assert saved_by_4 == pytest.approx(3 * saved_from_2)
    assert exposed[4].exposed_comm_s < exposed[None].exposed_comm_s
    # Its gradients are the backward's own: no flat buckets to zero, add into, divide.
    assert exposed[4].compute_s == exposed[2].compute_s < exposed[None].compute_s
