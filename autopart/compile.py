"""The torch.compile backend: `torch.compile(model, backend="autopart")`.

Dynamo hands over each captured graph with the model's parameters among its inputs.
The backend analyzes the graph (FLOPs, memory, parameters; logged) and, inside a
torch.distributed world of more than one process, makes the parameters' gradients
data-parallel: every backward through the graph all-reduces them in buckets, overlapped
with backward, and averages them over the world, as DistributedDataParallel would. Each
process feeds its own slice of the batch. Tensor and pipeline parallelism rewrite the
model itself and go through `autopart.parallelize`.

Averaging is right only if every rank runs the same graph: ranks whose data sends
them down different branches would sum the gradients of different parameters, silently
(DistributedDataParallel hangs or raises). So before each forward that will need
gradients, the ranks compare the graph they are about to run, with one all-reduce of
two integers, and all of them raise together if any differs.
"""

from __future__ import annotations

import hashlib
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
        signature = _signature(gm)

        def forward(*args: Any) -> Any:
            if torch.is_grad_enabled():
                _check_same_graph(signature, params[0].device)
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


def _signature(gm: fx.GraphModule) -> int:
    """The same integer on every rank for the same graph (its generated code), below
    2**62 so that it and its negation fit an int64."""
    return int.from_bytes(hashlib.sha256(gm.code.encode()).digest()[:8], "big") >> 2


def _check_same_graph(signature: int, device: torch.device) -> None:
    """Every rank about to run the graph `signature`, or all raise: the all-reduced
    maxima of (s, -s) give the largest and smallest signature of the world."""
    both = torch.tensor([signature, -signature], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    if both[0].item() != signature or -both[1].item() != signature:
        raise RuntimeError(
            "autopart: the ranks are running different compiled graphs (the model's "
            "control flow depends on each rank's data), so their gradients cannot be "
            "averaged. Make every rank take the same branches, or use a model without "
            "data-dependent control flow"
        )


autopart_backend = AutopartBackend()
