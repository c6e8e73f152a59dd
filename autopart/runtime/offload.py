"""ZeRO offload: the optimizer steps host copies of this rank's trained tensors.

The tensors are what the data-parallel state would otherwise step on the device:
ZeRO's shards (stages 1-3: flat shards, or whole parameters for an optimizer that is
not elementwise), or, with one data-parallel replica, the parameters themselves. The
optimizer's state lives next to the host copies and never touches the device.

On a GPU the transfers overlap the work on either side of them:

    down    each tensor's gradient goes to its pinned host buffer on a side stream as
            soon as the state says it is final (`send_down`: a ZeRO-1/2 bucket's last
            reduction, a single replica's parameter after its last backward pass),
            while backward goes on; the rest (ZeRO-3's shards, whole owned parameters)
            go when backward is over. The state's `finish` waits for all of them
            (`all_down`), so that what reads the gradients before the step (fp16's
            loss-scale check) reads these
    step    for an elementwise optimizer, during its step each of the user's parameter
            groups is cut into tiles of about a gradient bucket, and a tile's values go
            back up as soon as the optimizer has moved on to the next, so the host
            steps tile k + 1 while tile k travels; the user's optimizer keeps its own
            groups, and its hooks and schedulers see one step. Another optimizer's
            values go up after its step
    up      the device waits for the values before it next reads the tensors
            (`wait_up`)

On a CPU host and device are one memory: the copies are plain copies.

Master weights on the host (`master_weights="host"`, mixed precision only): the host
copies are the fp32 weights, and the device's tensors (those stepped, and whatever
holds their values whole: ZeRO-1/2's parameters) become 16-bit copies of them
(`lower`), so their gradients are 16-bit too. The link then carries 16-bit values both
ways, widened to fp32 on the host before the step and narrowed after it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from autopart.policy import ELEMENTWISE_OPTIMIZERS, GRAD_BUCKET_BYTES, optimizer_class
from autopart.runtime.dp_types import OptimizerFactory


class HostOptimizer:
    """The user's optimizer over host copies of `tensors` (device parameters)."""

    def __init__(
        self,
        tensors: list[nn.Parameter],
        optimizer: OptimizerFactory,
        tile_bytes: int = GRAD_BUCKET_BYTES,
        on_device: bool = False,
    ) -> None:
        """`on_device`: the copies stay beside the tensors (16-bit parameters' fp32
        masters on one replica, `LocalState`): nothing travels, the copies only widen."""
        self.tensors = tensors
        cuda = any(t.is_cuda for t in tensors) and not on_device
        home = tensors[0].device if on_device and tensors else torch.device("cpu")
        self.host = [_host_copy(t, home, pin=cuda) for t in tensors]
        self._grads = [
            torch.empty(h.shape, dtype=h.dtype, device=h.device, pin_memory=cuda) for h in self.host
        ]
        self._index = {id(t): i for i, t in enumerate(tensors)}
        self._of_host = {id(h): i for i, h in enumerate(self.host)}
        self._sent: set[int] = set()
        # the device tensors holding 16-bit copies of the host's (fp32) masters, by id
        self.lowered: dict[int, torch.Tensor] = {}
        self._staged_down: dict[int, torch.Tensor] = {}  # pinned 16-bit gradients
        self._staged_up: dict[int, torch.Tensor] = {}  # pinned 16-bit values
        self._stream = torch.cuda.Stream(tensors[0].device) if cuda else None
        self.tile_bytes = tile_bytes
        self.elementwise = optimizer_class(optimizer) in ELEMENTWISE_OPTIMIZERS
        self.optimizer = optimizer(self.host)

    def begin(self) -> None:
        """A step begins: no gradient is on its way or on the host."""
        self._sent.clear()
        for copy in self.host:
            copy.grad = None

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
            copy.grad.copy_(grad)  # widened, where the device's are 16-bit
            return
        target = copy.grad
        if grad.dtype != target.dtype:  # 16 bits over the link, widened in `all_down`
            target = self._staged(self._staged_down, i, grad.dtype)
        self._stream.wait_stream(torch.cuda.current_stream(grad.device))
        with torch.cuda.stream(self._stream):
            target.copy_(grad, non_blocking=True)
        grad.record_stream(self._stream)  # not reused before the copy has read it

    def all_down(self) -> None:
        """Send the gradients not sent yet, and wait until every one is on the host."""
        for i, tensor in enumerate(self.tensors):
            if i not in self._sent:
                self.send_down(tensor)
        self._sent.clear()
        if self._stream is not None:
            self._stream.synchronize()
        for i, staged in self._staged_down.items():
            grad = self.host[i].grad
            if grad is not None:
                grad.copy_(staged)

    def step(self) -> None:
        """The step on the host (after `all_down`), the values sent back up tile by tile
        as the optimizer leaves each (asynchronously on a GPU: see `wait_up`)."""
        if self._stream is not None:
            # Not before the device's work so far, which may still read the old values.
            self._stream.wait_stream(torch.cuda.current_stream(self.tensors[0].device))
        if not self.elementwise:
            self.optimizer.step()
            self._send_up(list(range(len(self.tensors))))
            return
        groups = self.optimizer.param_groups
        tiled = [
            (g, {**group, "params": tile})
            for g, group in enumerate(groups)
            for tile in _tiles(group["params"], self.tile_bytes)
        ]
        left = set(range(len(tiled)))

        def stepped(t: int) -> None:
            left.discard(t)
            self._send_up([self._of_host[id(h)] for h in tiled[t][1]["params"]])

        self.optimizer.param_groups = _SendingUp([tile for _, tile in tiled], stepped)
        try:
            self.optimizer.step()
        finally:
            self.optimizer.param_groups = groups
            for g, tile in tiled:  # whatever the step wrote into its groups' settings
                groups[g].update((k, v) for k, v in tile.items() if k != "params")
        for t in sorted(left):  # a tile the optimizer's pass did not leave
            stepped(t)

    def wait_up(self) -> None:
        """Make the device's work from here on wait for the updated values."""
        if self._stream is not None:
            torch.cuda.current_stream(self.tensors[0].device).wait_stream(self._stream)

    @torch.no_grad()
    def _send_up(self, indices: list[int]) -> None:
        if self._stream is None:
            for i in indices:
                self.tensors[i].copy_(self.host[i])
            return
        with torch.cuda.stream(self._stream):
            for i in indices:
                source: torch.Tensor = self.host[i]
                if self.tensors[i].dtype != source.dtype:  # narrowed here, 16 bits go up
                    source = self._staged(self._staged_up, i, self.tensors[i].dtype)
                    source.copy_(self.host[i])
                self.tensors[i].copy_(source, non_blocking=True)

    @torch.no_grad()
    def widen_back(self) -> None:
        """Undo `lower`, the run being over: every lowered tensor is fp32 again, holding
        its master where the host holds one whole of it, else its 16-bit value (ZeRO-1/2's
        whole parameters, whose masters are shards: `full_state_dict` has them exactly)."""
        for tensor, host in zip(self.tensors, self.host):
            if id(tensor) in self.lowered:
                tensor.data = host.detach().to(tensor.device)
        for lowered in self.lowered.values():
            lowered.data = lowered.data.to(self.host[0].dtype)
        self.lowered.clear()

    def _staged(self, buffers: dict[int, torch.Tensor], i: int, dtype: torch.dtype) -> torch.Tensor:
        """A pinned host buffer for tensor i's values in `dtype`, made on first use.
        Reused every step: the previous step's copy through it ended in `all_down`."""
        if i not in buffers:
            buffers[i] = torch.empty(self.host[i].shape, dtype=dtype, pin_memory=True)
        return buffers[i]


class _SendingUp(list):
    """A step's parameter groups, calling `stepped(t)` whenever what goes through them
    has left group t for the next (or for the end): an elementwise optimizer's single
    pass has then updated group t's tensors. A step hook that also goes through them
    sends them once more (the last send, after the pass, is what the device keeps)."""

    def __init__(self, groups: list[dict[str, Any]], stepped: Callable[[int], None]) -> None:
        super().__init__(groups)
        self._stepped = stepped

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for t, group in enumerate(list.__iter__(self)):
            yield group
            self._stepped(t)


def _tiles(params: list[torch.Tensor], tile_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of `params` of about `tile_bytes` each."""
    tiles: list[list[torch.Tensor]] = [[]]
    size = 0
    for p in params:
        if tiles[-1] and size + p.numel() * p.element_size() > tile_bytes:
            tiles.append([])
            size = 0
        tiles[-1].append(p)
        size += p.numel() * p.element_size()
    return tiles


def _host_copy(tensor: nn.Parameter, home: torch.device, pin: bool) -> nn.Parameter:
    """A copy of `tensor` on `home` (the host) for the optimizer to step (pinned where
    the tensors are on a GPU, so that the copies to and fro run asynchronously)."""
    copy = tensor.detach().to(home, copy=True)
    return nn.Parameter(copy.pin_memory() if pin else copy)
