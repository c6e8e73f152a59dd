"""Recording what a graph computes: each operator's output, and each parameter's gradient.

`install_probes(gm, recorder)` inserts, after every operator of a graph, a call to the
recorder (a submodule of the graph), which keeps a detached float copy of the output
under the node's name, once per forward call (per microbatch), while it is active. The
rank programs and the single-device graph get the same probes, so their nodes' values
can be set side by side by name. Operators outlined into recomputed blocks are not
probed (they run inside a checkpointed submodule).

`gradient_pieces(pm)` records, at the first optimizer step, the gradient of every
tensor the optimizer steps, as pieces of whole named parameters (runtime/holdings.py):
whatever the plan, the pieces of all ranks rebuild the whole gradients.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

from autopart.ops.meta import COLLECTIVE
from autopart.runtime.holdings import Holdings
from autopart.runtime.parallel_module import ParallelModule
from autopart.runtime.pieces import Piece

PROBE = "autopart_probe"


class Recorder(nn.Module):
    """Keeps each probed node's outputs, in call order, while `active`."""

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[str, list[torch.Tensor]] = {}
        self.active = True

    def forward(self, value: Any, name: str) -> None:
        if self.active and isinstance(value, torch.Tensor) and value.is_floating_point():
            self.values.setdefault(name, []).append(value.detach().float().cpu().clone())


def install_probes(gm: fx.GraphModule, recorder: Recorder) -> fx.GraphModule:
    """Probe every operator of `gm` (in place); the collectives a rewrite inserted are
    left out, as the single-device graph has none."""
    gm.add_submodule(PROBE, recorder)
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or COLLECTIVE.has(node):
            continue
        with gm.graph.inserting_after(node):
            gm.graph.call_module(PROBE, (node,), {"name": node.name})
    gm.recompile()
    return gm


class GradientRecorder:
    """The pieces of every stepped tensor's gradient at `pm`'s first optimizer step."""

    def __init__(self, pm: ParallelModule) -> None:
        if pm.optimizer is None:
            raise ValueError("verify needs parallelize(..., optimizer=...)")
        self.holdings = Holdings(pm)
        self.pieces: list[Piece] = []
        self._handle = pm.optimizer.register_step_pre_hook(self._record)

    def _record(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group in optimizer.param_groups:
            for tensor in group["params"]:
                if tensor.grad is not None:
                    grad = tensor.grad.detach().float().cpu().clone()
                    self.pieces += self.holdings.of(tensor).pieces(grad)
        self._handle.remove()  # the first step's only
