"""ParallelModule: the per-rank program, its process groups, and the training step."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh

from autopart.batch import split_batch
from autopart.mesh import Axis
from autopart.passes.params import parameter_readers
from autopart.plan import Plan
from autopart.runtime.grad_sync import GradientSync

LossFn = Callable[[Any, Any], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class ParallelModule(nn.Module):
    """Runs one rank's share of a plan. `train_step` does a whole optimizer step."""

    def __init__(
        self,
        program: fx.GraphModule,
        plan: Plan,
        device_mesh: DeviceMesh,
        loss_fn: LossFn | None,
        optimizer: OptimizerFactory | None,
    ) -> None:
        super().__init__()
        self.program = program
        self.plan = plan
        self.device_mesh = device_mesh
        self.loss_fn = loss_fn
        self.dp_rank = device_mesh.get_local_rank(Axis.DP.value)
        self.grad_sync = GradientSync(
            params_in_backward_order(program), device_mesh.get_group(Axis.DP.value)
        )
        self.optimizer = optimizer(list(program.parameters())) if optimizer else None

    @property
    def graph(self) -> fx.GraphModule:
        """This rank's graph: `pm.graph.print_readable()` shows every inserted collective."""
        return self.program

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.program(*args, **kwargs)

    def local_batch(self, batch: Any) -> Any:
        """This rank's slice of a global batch."""
        return split_batch(batch, self.dp_rank, self.plan.dp)

    def train_step(self, inputs: Any, target: Any) -> torch.Tensor:
        """Forward, backward, gradient sync and optimizer step on the global batch
        `inputs`; returns the global mean loss, the same on every rank."""
        if self.loss_fn is None or self.optimizer is None:
            raise ValueError("train_step needs parallelize(..., loss_fn=..., optimizer=...)")
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        output = self.program(*self.local_batch(args))
        loss = self.loss_fn(output, self.local_batch(target))
        self.grad_sync.begin(loss)
        loss.backward()
        global_loss = self.grad_sync.finish()
        self.optimizer.step()
        return global_loss

    def close(self) -> None:
        """Detach autopart's hooks from the model's parameters."""
        self.grad_sync.close()


def params_in_backward_order(gm: fx.GraphModule) -> list[nn.Parameter]:
    """Parameters in the order backward produces their gradients: the reverse of their
    first use in forward (unused ones last). Needs the params analysis."""
    readers = parameter_readers(gm)
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    first_use = {fqn: position[nodes[0]] for fqn, nodes in readers.items()}
    named = dict(gm.named_parameters())
    ordered = sorted(named, key=lambda fqn: -first_use.get(fqn, -1))
    used = [fqn for fqn in ordered if fqn in first_use]
    unused = [fqn for fqn in ordered if fqn not in first_use]
    return [named[fqn] for fqn in used + unused]
