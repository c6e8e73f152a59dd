"""ZeRO offload: the optimizer steps host copies of this rank's trained tensors.

The tensors are what the data-parallel state would otherwise step on the device:
ZeRO's flat shards (stages 1-3), or, with one data-parallel replica, the parameters
themselves.
The optimizer's state lives next to the host copies and never touches the device.

On a GPU each tensor's gradient goes down to its pinned host buffer on a side stream
as soon as the state knows it is final (`send_down`: a bucket's last reduction, a
parameter's last backward pass), so the transfers run while backward goes on; the
state's `finish` waits only for the last of them (`all_down`), so that what reads the
gradients between backward and the step (fp16's loss-scale check) reads the host's.
After the step the updated values go back up on
the same stream, and the device waits for them before it next reads the tensors
(`wait_up`). On a CPU host and device are one memory: the copies are plain copies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from autopart.runtime.data_parallel import OptimizerFactory


class HostOptimizer:
    """The user's optimizer over host copies of `tensors` (device parameters)."""

    def __init__(self, tensors: list[nn.Parameter], optimizer: OptimizerFactory) -> None:
        self.tensors = tensors
        cuda = any(t.is_cuda for t in tensors)
        self.host = [_host_copy(t, pin=cuda) for t in tensors]
        self._grads = [torch.empty(h.shape, dtype=h.dtype, pin_memory=cuda) for h in self.host]
        self._index = {id(t): i for i, t in enumerate(tensors)}
        self._sent: set[int] = set()
        self._stream = torch.cuda.Stream(tensors[0].device) if cuda else None
        self.optimizer = optimizer(self.host)

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
        """The step on the host (after `all_down`), and the updated values back up,
        asynchronously on a GPU (see `wait_up`)."""
        self.optimizer.step()
        with torch.no_grad():
            if self._stream is None:
                for tensor, copy in zip(self.tensors, self.host):
                    tensor.copy_(copy)
                return
            # Not before the device's work so far, which may still read the old values.
            self._stream.wait_stream(torch.cuda.current_stream(self.tensors[0].device))
            with torch.cuda.stream(self._stream):
                for tensor, copy in zip(self.tensors, self.host):
                    tensor.copy_(copy, non_blocking=True)

    def wait_up(self) -> None:
        """Make the device's work from here on wait for the updated values."""
        if self._stream is not None:
            torch.cuda.current_stream(self.tensors[0].device).wait_stream(self._stream)


def _host_copy(tensor: nn.Parameter, pin: bool) -> nn.Parameter:
    """A host copy of `tensor` for the optimizer to step (pinned where the tensors are
    on a GPU, so that the copies to and fro run asynchronously)."""
    copy = tensor.detach().to("cpu", copy=True)
    return nn.Parameter(copy.pin_memory() if pin else copy)
