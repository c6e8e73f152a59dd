"""Dynamo's graph as a model autopart can capture and plan, and back as a graph that
takes its parameters as inputs.

Dynamo hands the backend a graph whose placeholders include the model's parameters
(the user's own `nn.Parameter` objects, which the user's optimizer holds). `DynamoModel`
registers those same objects under the model's own names (read from dynamo's sources:
`L['self']._modules['fc']._parameters['weight']` is `fc.weight`), so the graph becomes an
ordinary module that `autopart.capture` exports and the solver plans by parameter name.
After the rewrite, `lift_parameters` turns each parameter read back into an input, so
the rank program computes on whatever the backend feeds it: the user's parameter
itself, its tensor-parallel slice, or a parameter gathered from its ZeRO owner.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn

_INDEX = re.compile(r"\['([^']+)'\]")


class DynamoModel(nn.Module):
    """Dynamo's `gm` as a module: its parameter and buffer inputs are registered, by the
    model's names, as this module's own; the other inputs stay inputs."""

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
        super().__init__()
        self.graph_module = gm
        # For each placeholder: the name of a parameter or buffer, or None for data.
        self.slots: list[str | None] = []
        names: dict[int, str] = {}
        for node, value in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
            source = _source(node)
            is_buffer = isinstance(value, torch.Tensor) and "._buffers[" in source
            if not (isinstance(value, nn.Parameter) or is_buffer):
                self.slots.append(None)
                continue
            name = names.get(id(value))
            if name is None:
                name = names[id(value)] = _unique(_state_name(node, source), set(names.values()))
                _register(self, name, value)
            self.slots.append(name)

    def data_inputs(self, inputs: Sequence[Any]) -> tuple[Any, ...]:
        """The inputs of dynamo's call that are not parameters, in order."""
        return tuple(x for x, slot in zip(inputs, self.slots) if slot is None)

    def forward(self, *data: Any) -> Any:
        feed = iter(data)
        state = dict(self.named_parameters()) | dict(self.named_buffers())
        args = [next(feed) if s is None else state[s] for s in self.slots]
        return self.graph_module(*args)


def _source(node: fx.Node) -> str:
    """Where dynamo read the input from: `L['self']._modules['fc']._parameters['weight']`."""
    grapharg = node.meta.get("grapharg")
    source = getattr(getattr(grapharg, "source", None), "name", "")
    return str(source() if callable(source) else source)


def _state_name(node: fx.Node, source: str) -> str:
    """A parameter's or buffer's name in the compiled model, from dynamo's source."""
    parts = _INDEX.findall(source)
    if source.startswith("L['self']") and parts:
        # Keys alternate between a container (_modules, _parameters) and a name.
        return ".".join(parts)
    return node.name


def _unique(name: str, taken: set[str]) -> str:
    candidate, n = name, 1
    while candidate in taken:
        candidate, n = f"{name}_{n}", n + 1
    return candidate


def _register(root: nn.Module, name: str, value: torch.Tensor) -> None:
    *path, leaf = name.split(".")
    module = root
    for part in path:
        if not isinstance(getattr(module, part, None), nn.Module):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    if isinstance(value, nn.Parameter):
        module.register_parameter(leaf, value)
    else:
        module.register_buffer(leaf, value, persistent=False)


def lift_parameters(gm: fx.GraphModule, names: dict[str, str]) -> tuple[list[str], Any]:
    """Replace every read of a parameter in `gm` (a `get_attr` of one of `names`:
    attribute path -> canonical name) by a new input, placed after the data inputs, one
    per canonical name, and remove the attributes. The graph then takes and returns flat
    tensors (the exporter's pytree wrapping is dropped: dynamo's inputs are flat).
    Returns the canonical names in the order of the new inputs, and the output's
    pytree spec to rebuild what the model returns."""
    graph = gm.graph
    out_spec = (
        graph._codegen.pytree_info.out_spec if hasattr(graph._codegen, "pytree_info") else None
    )
    graph.set_codegen(fx.graph.CodeGen())
    # The exporter's hooks check calls against the pytree spec just dropped.
    gm._forward_pre_hooks.clear()
    gm._forward_hooks.clear()
    placeholders = list(graph.find_nodes(op="placeholder"))
    inputs: dict[str, fx.Node] = {}
    anchor = placeholders[-1] if placeholders else None
    for node in list(graph.find_nodes(op="get_attr")):
        canonical = names.get(str(node.target))
        if canonical is None:
            continue
        if canonical not in inputs:
            insert = graph.inserting_after(anchor) if anchor else graph.inserting_before(None)
            with insert:
                anchor = inputs[canonical] = graph.placeholder(canonical.replace(".", "_"))
            anchor.meta.update(node.meta)
        node.replace_all_uses_with(inputs[canonical])
        graph.erase_node(node)
    for attr in names:
        module_path, _, leaf = attr.rpartition(".")
        owner = gm.get_submodule(module_path) if module_path else gm
        if leaf in owner._parameters:
            del owner._parameters[leaf]
    graph.lint()
    gm.recompile()
    return list(inputs), out_spec
