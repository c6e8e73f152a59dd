"""ZeRO offload: the optimizer steps host copies of this rank's trained tensors.

The tensors are what the data-parallel state would otherwise step on the device:
ZeRO's flat shards (stages 1-3), or, with one data-parallel replica, the parameters
themselves. The optimizer's state lives next to the host copies and never touches the
device.

On a GPU the transfers overlap the work on either side of them:

    down    each tensor's gradient goes to its pinned host buffer on a side stream as
            soon as the state knows it is final (`send_down`: a bucket's last
            reduction, a parameter's last backward pass), while backward goes on; the
            state's `finish` waits for the last of them (`all_down`), so that what
            reads the gradients before the step (fp16's loss-scale check) reads these
    step    for an elementwise optimizer the host copies are cut into tiles of about a
            gradient bucket, one parameter group each, and a tile's updated values go
            back up as soon as the optimizer has moved on to the next tile, so the host
            steps tile k + 1 while tile k travels; any other optimizer steps one group,
            sent up after it
    up      the device waits for the values before it next reads the tensors
            (`wait_up`)

On a CPU host and device are one memory: the copies are plain copies.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from autopart.policy import ELEMENTWISE_OPTIMIZERS, GRAD_BUCKET_BYTES, optimizer_class

if TYPE_CHECKING:
    from autopart.runtime.data_parallel import OptimizerFactory


class HostOptimizer:
    """The user's optimizer over host copies of `tensors` (device parameters)."""

    def __init__(
        self,
        tensors: list[nn.Parameter],
        optimizer: OptimizerFactory,
        tile_bytes: int = GRAD_BUCKET_BYTES,
    ) -> None:
        self.tensors = tensors
        cuda = any(t.is_cuda for t in tensors)
        self.host = [_host_copy(t, pin=cuda) for t in tensors]
        self._grads = [torch.empty(h.shape, dtype=h.dtype, pin_memory=cuda) for h in self.host]
        self._index = {id(t): i for i, t in enumerate(tensors)}
        self._sent: set[int] = set()
        self._stream = torch.cuda.Stream(tensors[0].device) if cuda else None
        elementwise = optimizer_class(optimizer) in ELEMENTWISE_OPTIMIZERS
        self.tiles = _tiles(self.host, tile_bytes) if elementwise else [list(range(len(tensors)))]
        groups = [{"params": [self.host[i] for i in tile]} for tile in self.tiles]
        # Given parameter groups, as torch's optimizers take them (the elementwise ones).
        self.optimizer = optimizer(cast(Any, groups) if len(groups) > 1 else self.host)

    def send_down(self, tensor: torch.Tensor) -> None:
        """Start copying `tensor`'s gradient, final for this step, to the host."""
        i = self._index[id(tensor)]
        grad, copy = tensor.grad, self.host[i]
        self._sent.add(i)
        if grad is None:  # no gradient this step: the optimizer skips it, as on the device
            copy.grad = None
            return
        copy.grad = self._grads[i]
        if self._stream is None:
            copy.grad.copy_(grad)
            return
        self._stream.wait_stream(torch.cuda.current_stream(grad.device))
        with torch.cuda.stream(self._stream):
            copy.grad.copy_(grad, non_blocking=True)
        grad.record_stream(self._stream)  # not reused before the copy has read it

    def all_down(self) -> None:
        """Send the gradients not sent yet, and wait until every one is on the host."""
        for i, tensor in enumerate(self.tensors):
            if i not in self._sent:
                self.send_down(tensor)
        self._sent.clear()
        if self._stream is not None:
            self._stream.synchronize()

    def step(self) -> None:
        """The step on the host (after `all_down`), each tile's values sent back up as
        the optimizer leaves it (asynchronously on a GPU: see `wait_up`)."""
        if self._stream is not None:
            # Not before the device's work so far, which may still read the old values.
            self._stream.wait_stream(torch.cuda.current_stream(self.tensors[0].device))
        groups = self.optimizer.param_groups
        left = set(range(len(groups)))

        def stepped(g: int) -> None:
            left.discard(g)
            self._send_up(self.tiles[g])

        self.optimizer.param_groups = _SendingUp(groups, stepped)
        try:
            self.optimizer.step()
        finally:
            self.optimizer.param_groups = groups
        for g in sorted(left):  # an optimizer that did not go through every group
            self._send_up(self.tiles[g])

    def wait_up(self) -> None:
        """Make the device's work from here on wait for the updated values."""
        if self._stream is not None:
            torch.cuda.current_stream(self.tensors[0].device).wait_stream(self._stream)

    @torch.no_grad()
    def _send_up(self, tile: list[int]) -> None:
        if self._stream is None:
            for i in tile:
                self.tensors[i].copy_(self.host[i])
            return
        with torch.cuda.stream(self._stream):
            for i in tile:
                self.tensors[i].copy_(self.host[i], non_blocking=True)


class _SendingUp(list):
    """An optimizer's parameter groups, calling `stepped(g)` when the optimizer, going
    through them in a step, has left group g for the next (or for the end): an
    elementwise optimizer's single pass has then updated group g's tensors."""

    def __init__(self, groups: list[dict[str, Any]], stepped: Callable[[int], None]) -> None:
        super().__init__(groups)
        self._stepped = stepped

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for g, group in enumerate(list.__iter__(self)):
            yield group
            self._stepped(g)


def _tiles(host: list[nn.Parameter], tile_bytes: int) -> list[list[int]]:
    """Consecutive runs of `host`'s indices of about `tile_bytes` each."""
    tiles: list[list[int]] = [[]]
    size = 0
    for i, t in enumerate(host):
        if tiles[-1] and size + t.numel() * t.element_size() > tile_bytes:
            tiles.append([])
            size = 0
        tiles[-1].append(i)
        size += t.numel() * t.element_size()
    return tiles


def _host_copy(tensor: nn.Parameter, pin: bool) -> nn.Parameter:
    """A host copy of `tensor` for the optimizer to step (pinned where the tensors are
    on a GPU, so that the copies to and fro run asynchronously)."""
    copy = tensor.detach().to("cpu", copy=True)
    return nn.Parameter(copy.pin_memory() if pin else copy)
