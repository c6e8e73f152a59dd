"""Models built on the meta device.

A model too large for one machine is built with `init_empty_weights()` (parameters on
the meta device, buffers real) and captured as it is; after the rewrite each rank
materializes only its own pieces (passes/materialize.py), from a state dict or from a
checkpoint that `save_checkpoint` wrote (runtime/checkpoint.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn


@contextlib.contextmanager
def init_empty_weights() -> Iterator[None]:
    """Build modules with parameters on the meta device and buffers real (buffers such
    as rotary frequencies are computed in __init__ and are often not in checkpoints)."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            module._parameters[name] = meta

    # setattr: mypy rightly refuses to assign to a method; this is a deliberate patch.
    setattr(nn.Module, "register_parameter", register_on_meta)  # noqa: B010
    try:
        yield
    finally:
        setattr(nn.Module, "register_parameter", register)  # noqa: B010
