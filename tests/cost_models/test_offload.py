"""What ZeRO offload's host step costs: the gradients' trip down hides behind backward,
and the parameters' trip up behind the host's pass over the optimizer state, tile by
tile, but for the last tile."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autopart.cost_models.memory import FP32_WEIGHTS, HALF_WEIGHTS
from autopart.cost_models.offload import host_step_time
from autopart.mesh import PRESETS

PARAMS = 1e9
LAST = 25e6  # bytes of the last gradients to go down
TILE = 25e6  # bytes of weights the host steps at a time


def test_the_gradients_go_down_behind_backward_and_the_values_up_behind_the_step():
    device = PRESETS["a100-80g"]
    link, host = device.host_bandwidth, device.host_memory_bandwidth
    down, last = PARAMS * 4 / link, LAST / link
    host_pass = PARAMS * (4 + 4 + 8) / host  # weights, gradients, Adam's two moments
    up = PARAMS * 4 / link
    assert host_pass > up  # on this host the pass is the longer: the trip up hides
    tail = TILE / (PARAMS * 4) * up  # the last tile's trip up
    exposed = host_step_time(PARAMS, 0.0, FP32_WEIGHTS, device, LAST, TILE)
    assert exposed == pytest.approx(down + host_pass + tail)
    hidden = host_step_time(PARAMS, 10 * down, FP32_WEIGHTS, device, LAST, TILE)
    assert hidden == pytest.approx(last + host_pass + tail)
    half = host_step_time(PARAMS, down / 2, FP32_WEIGHTS, device, LAST, TILE)
    assert half == pytest.approx(down / 2 + host_pass + tail)


def test_a_slow_host_link_exposes_the_trip_up_and_one_tile_of_the_step():
    device = replace(PRESETS["a100-80g"], host_bandwidth=2e9)
    link, host = device.host_bandwidth, device.host_memory_bandwidth
    up, host_pass = PARAMS * 4 / link, PARAMS * 16 / host
    assert up > host_pass
    head = TILE / (PARAMS * 4) * host_pass  # the first tile's pass, before any goes up
    hidden = host_step_time(PARAMS, 1e9, FP32_WEIGHTS, device, LAST, TILE)
    assert hidden == pytest.approx(LAST / link + up + head)


def test_host_masters_halve_the_link_and_add_the_host_casts():
    """With the master weights on the host the link carries 16-bit gradients and
    values; the host also widens those gradients (2 bytes read, 4 written) and narrows
    the values (4 read, 2 written) around its fp32 pass."""
    device = replace(PRESETS["a100-80g"], host_bandwidth=2e9)  # the link the longer
    link, host = device.host_bandwidth, device.host_memory_bandwidth
    up, host_pass = PARAMS * 2 / link, PARAMS * (16 + 6 + 6) / host
    assert up > host_pass
    head = TILE / (PARAMS * 4) * host_pass  # tiles of the host's fp32 weights
    hidden = host_step_time(PARAMS, 1e9, HALF_WEIGHTS, device, LAST, TILE)
    assert hidden == pytest.approx(LAST / link + up + head)
    exposed = host_step_time(PARAMS, 0.0, HALF_WEIGHTS, device, LAST, TILE)
    assert exposed == pytest.approx(PARAMS * 2 / link + up + head)
