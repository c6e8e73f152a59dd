"""The unmodified model on one device: each operator's output in the first forward, the
losses of the steps and the first step's gradients, for `autopart.verify` to compare."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import fx, nn

from autopart.api import captured_for_planning
from autopart.runtime.parallel_module import LossFn, OptimizerFactory
from autopart.verify.probes import Recorder, install_probes


def operator_values(
    model: nn.Module, args: tuple
) -> tuple[dict[str, torch.Tensor], list[str], set[str], dict[str, fx.Node]]:
    """Each operator's output on one device, in graph order; the nodes the model's
    outputs come from; the nodes by name."""
    captured = captured_for_planning(copy.deepcopy(model), args)
    gm = captured.gm
    graph = {n.name: n for n in gm.graph.nodes}
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outputs = {n.name for n in output.all_input_nodes}
    recorder = Recorder()
    install_probes(gm, recorder)
    with torch.no_grad():
        gm(*args)
    values = {name: vs[0] for name, vs in recorder.values.items()}
    return values, list(values), outputs, graph


def training(
    model: nn.Module,
    args: tuple,
    target: Any,
    loss_fn: LossFn,
    optimizer: OptimizerFactory,
    steps: int,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The losses of `steps` steps on one device, and the first step's gradients."""
    opt = optimizer(model.parameters())
    losses, grads = [], {}
    for step in range(steps):
        opt.zero_grad()
        loss = loss_fn(model(*args), target)
        loss.backward()
        if step == 0:
            grads = {
                n: p.grad.detach().float().clone()
                for n, p in model.named_parameters()
                if p.grad is not None
            }
        opt.step()
        losses.append(loss.item())
    return losses, grads
