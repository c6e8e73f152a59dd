"""The torch.compile backend: `torch.compile(model, backend="autopart")`.

Dynamo hands over each captured graph with the model's parameters among its inputs.
The backend analyzes the graph (FLOPs, memory, parameters; logged) and, inside a
torch.distributed world of more than one process, makes the parameters' gradients
data-parallel: every backward through the graph all-reduces them in buckets, overlapped
with backward, and averages them over the world, as DistributedDataParallel would. Each
process feeds its own slice of the batch. Tensor and pipeline parallelism rewrite the
model itself and go through `autopart.parallelize`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from autopart.capture import from_graph_module
from autopart.passes import analyze, total_flops
from autopart.runtime.grad_sync import GradientSync

log = logging.getLogger("autopart.compile")


class AutopartBackend:
    """A dynamo backend. One instance keeps the gradient syncs it attached, so a graph
    compiled again (a recompilation) does not hook the same parameters twice."""

    def __init__(self) -> None:
        self._synced: dict[tuple[int, ...], GradientSync] = {}

    def __call__(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], **_: Any
    ) -> Callable[..., Any]:
        captured = from_graph_module(gm, tuple(example_inputs))
        analyze(captured.gm, captured.context())
        log.info(
            "autopart: graph of %d nodes, %s forward FLOPs",
            len(gm.graph.nodes),
            total_flops(captured.gm),
        )
        params = [x for x in example_inputs if isinstance(x, nn.Parameter) and x.requires_grad]
        if not (params and dist.is_initialized() and dist.get_world_size() > 1):
            return gm.forward
        sync = self._sync_for(params)

        def forward(*args: Any) -> Any:
            if torch.is_grad_enabled():
                sync.begin()
            return gm.forward(*args)

        return forward

    def _sync_for(self, params: list[nn.Parameter]) -> GradientSync:
        key = tuple(id(p) for p in params)
        if key not in self._synced:
            # Placeholders follow first use in forward; backward runs the other way.
            world = dist.group.WORLD
            assert world is not None, "only called once torch.distributed is initialized"
            self._synced[key] = GradientSync(
                list(reversed(params)), world, finish_with_backward=True
            )
        return self._synced[key]


autopart_backend = AutopartBackend()
