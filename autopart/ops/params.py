"""Finding a graph's parameters: the nodes that read each one, the attributes that hold them."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

import torch
from torch import fx, nn

from autopart.ops.meta import PARAMS


def parameter_names(gm: nn.Module) -> dict[str, str]:
    """Every name a parameter is reachable by -> its canonical (first) FQN: tied weights
    share one."""
    canonical: dict[int, str] = {}
    return {
        name: canonical.setdefault(id(p), name)
        for name, p in gm.named_parameters(remove_duplicate=False)
    }


def trainable_names(gm: nn.Module) -> set[str]:
    """Every name a parameter that requires grad is reachable by (tied ones by each)."""
    return {name for name, p in gm.named_parameters(remove_duplicate=False) if p.requires_grad}


def parameter_readers(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """Parameter FQN -> the nodes that read it, in graph order."""
    readers: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        for fqn in PARAMS.get(node):
            readers.setdefault(fqn, []).append(node)
    return readers


def parameter_attributes(gm: fx.GraphModule) -> list[tuple[fx.Node, nn.Parameter]]:
    """Every get_attr node of `gm`'s graph that reads a parameter, with the parameter."""
    found = []
    for node in gm.graph.find_nodes(op="get_attr"):
        value: object = gm
        for part in str(node.target).split("."):
            value = getattr(value, part, None)
        if isinstance(value, nn.Parameter):
            found.append((node, value))
    return found


def parameters_named(modules: Iterable[nn.Module], fqns: Collection[str]) -> set[int]:
    """The ids of the `modules`' parameters whose qualified names are in `fqns`."""
    return {id(p) for m in modules for name, p in m.named_parameters() if name in fqns}


@torch.no_grad()
def lower(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """`tensors` (device parameters) hold `dtype` copies of their values from here on,
    the same tensors still (the graphs and hooks that hold them keep them): master
    weights on the host (runtime/offload.py)."""
    for t in tensors:
        t.data = t.data.to(dtype)
    return list(tensors)
