"""Each rank's programs handed to inductor (`parallelize(..., compile=True)`).

A stage's graph is compiled as a whole, forward and backward (AOTAutograd), where it
is called: the executor's microbatch loop and the pipeline's stage modules. Its
collectives are functional collectives, which dynamo traces into the graph, so inductor
sees them beside the compute; what it cannot trace (a hook, an autograd Function of the
runtime's) splits the graph into compiled regions around it. The graph module itself
stays as the rewrite made it: checkpoints, holdings and `pm.graph` read it, and its
parameters are the ones the compiled code trains. A program made again for inputs of
other shapes is compiled again, as dynamo recompiles on a new shape.

Compile time is logged (logger "autopart.compile", INFO) once for each graph inductor
compiles: a region's forward when the stage is first called, its backward when
backward first reaches it (AOTAutograd compiles that lazily), and again on a
recompilation. The cost models price a compiled plan (`Plan.compiled`) as
`cost_models/fusion.py` says.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import fx

log = logging.getLogger("autopart.compile")


class Compiled:
    """`stage` compiled by torch.compile with inductor, each graph's compile time logged
    (`inductor`)."""

    def __init__(self, stage: fx.GraphModule) -> None:
        self.stage = stage
        self.run: Callable[..., Any] = torch.compile(stage, backend=inductor)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)


def inductor(gm: fx.GraphModule, example_inputs: Sequence[Any], **_: Any) -> Callable[..., Any]:
    """`gm` compiled as torch.compile's default backend compiles it (`compile_fx`),
    logging how long inductor took for its forward graph and, when backward first runs
    it, its backward graph."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    nodes = sum(n.op == "call_function" for n in gm.graph.nodes)

    def timed(graph: fx.GraphModule, inputs: Sequence[Any], **kwargs: Any) -> Any:
        began = time.perf_counter()
        compiled = compile_fx_inner(graph, inputs, **kwargs)
        what = "backward" if kwargs.get("is_backward") else "forward"
        log.info(
            "autopart: inductor compiled the %s of a graph of %d operators in %.1f s",
            what,
            nodes,
            time.perf_counter() - began,
        )
        return compiled

    return cast(Callable[..., Any], compile_fx(gm, list(example_inputs), inner_compile=timed))


def runner(stage: fx.GraphModule, compile: bool) -> Callable[..., Any]:
    """What runs `stage`: itself, or its compiled form."""
    return Compiled(stage) if compile else stage
