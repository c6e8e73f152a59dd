"""Each rank's programs handed to inductor (`parallelize(..., compile=True)`).

A stage's graph is compiled as a whole, forward and backward (AOTAutograd), where it
is called: the executor's microbatch loop and the pipeline's stage modules. Its
collectives are functional collectives, which dynamo traces into the graph, so inductor
sees them beside the compute; what it cannot trace (a hook, an autograd Function of the
runtime's) splits the graph into compiled regions around it. The graph module itself
stays as the rewrite made it: checkpoints, holdings and `pm.graph` read it, and its
parameters are the ones the compiled code trains. A program made again for inputs of
other shapes is compiled again, as dynamo recompiles on a new shape.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

log = logging.getLogger("autopart.compile")


class Compiled:
    """`stage` compiled by torch.compile (inductor), logging how long its first call,
    which compiles it, took."""

    def __init__(self, stage: fx.GraphModule) -> None:
        self.stage = stage
        self.run: Callable[..., Any] = torch.compile(stage)
        self.first = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.first:
            return self.run(*args, **kwargs)
        began = time.perf_counter()
        out = self.run(*args, **kwargs)
        self.first = False
        log.info("autopart: compiled a stage's forward in %.1f s", time.perf_counter() - began)
        return out


def runner(stage: fx.GraphModule, compile: bool) -> Callable[..., Any]:
    """What runs `stage`: itself, or its compiled form."""
    return Compiled(stage) if compile else stage
