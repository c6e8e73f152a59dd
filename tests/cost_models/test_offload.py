"""What ZeRO offload's host step costs: the gradients' trip down hides behind backward,
the host's pass over the optimizer state and the parameters' trip up do not."""

from __future__ import annotations

import pytest

from autopart.cost_models.offload import host_step_time
from autopart.mesh import PRESETS

PARAMS = 1e9
LAST = 25e6  # bytes of the last gradients to go down


def test_the_gradients_go_down_behind_backward_and_the_rest_is_exposed():
    device = PRESETS["a100-80g"]
    link, host = device.host_bandwidth, device.host_memory_bandwidth
    down, last = PARAMS * 4 / link, LAST / link
    host_pass = PARAMS * (4 + 4 + 8) / host  # weights, gradients, Adam's two moments
    up = PARAMS * 4 / link
    exposed = host_step_time(PARAMS, 0.0, "fp32", device, LAST)
    assert exposed == pytest.approx(down + host_pass + up)
    hidden = host_step_time(PARAMS, 10 * down, "fp32", device, LAST)
    assert hidden == pytest.approx(last + host_pass + up)
    half = host_step_time(PARAMS, down / 2, "fp32", device, LAST)
    assert half == pytest.approx(down / 2 + host_pass + up)
