"""What ZeRO offload's step on the host costs (`runtime/offload.py` runs it)."""

from __future__ import annotations

from autopart.cost_models.memory import FP32_WEIGHTS
from autopart.cost_models.pipeline import exposed_sync
from autopart.mesh import DeviceSpec

HOST_WEIGHT_BYTES = FP32_WEIGHTS[0]  # the host's copies, tiled by their bytes


def host_step_time(
    params: float,
    hiding: float,
    per_param: tuple[int, int, int],
    device: DeviceSpec,
    last_bytes: float,
    tile_bytes: float,
) -> float:
    """Seconds of the host step for one rank's `params` (its ZeRO shard, or all of
    them with one replica), an Adam-like elementwise optimizer's:

    down  the gradients go down the host link as they become final, while the last
          microbatch's backward (`hiding` seconds; 0 where they go only once backward
          is over) goes on: what backward cannot cover is exposed, and the last
          `last_bytes` of gradients;
    step  the optimizer's pass over weights, gradients and state in host memory, tile
          by tile (`tile_bytes` of weights), each tile's values going back up while
          the next is stepped: a two-stage pipeline, the longer stage's whole time
          and one tile of the shorter (`tile_bytes` of the host's fp32 weights).

    `per_param`: bytes per parameter of (weights, gradients, state), as
    `memory.state_bytes`: the link carries the device's weights and gradients, the
    host's pass touches them all."""
    param_bytes, grad_bytes, _ = per_param
    link = device.host_bandwidth
    down = params * grad_bytes / link
    # The host steps fp32 weights (the masters, where the device's are 16-bit copies:
    # then it also widens their gradients and narrows their values, 2 + 4 bytes each).
    host_bytes = sum(per_param)
    if param_bytes < HOST_WEIGHT_BYTES:
        host_bytes += (grad_bytes + HOST_WEIGHT_BYTES) + (HOST_WEIGHT_BYTES + param_bytes)
    host_pass = params * host_bytes / device.host_memory_bandwidth
    up = params * param_bytes / link
    tile = min(1.0, tile_bytes / (params * HOST_WEIGHT_BYTES)) if params else 0.0
    step = max(host_pass, up) + tile * min(host_pass, up)
    return exposed_sync(down, hiding, min(down, last_bytes / link)) + step
