"""The full graph of a model, built from a capture of its shortened stack.

The shortened capture holds the stack's first `KEPT` blocks. Its last block is the
template: each of its inputs is its own operator, one of the block before it (the
"previous" block), or a value computed once and shared (before the stack, or in the
first block). The middle block must follow the same rule from the first, operator by
operator; then each further copy is the template read against the copy before it,
with its own parameters, and what follows the stack reads the last copy. Anything that
does not line up gives None, and the caller captures the whole model instead.

The graph built is the one torch.export gives for the whole model, node for node, up
to the nodes' names: the same operators, arguments, shapes and module paths.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from autopart.capture import Captured, capture
from autopart.ops.meta import MODULE_PATH
from autopart.passes.module_path import module_path_pass
from autopart.repeated_stack import KEPT, Stack, main_stack, shortened

log = logging.getLogger("autopart.capture")

_CALLS = ("call_function", "call_method", "call_module")
Key = tuple[str, Any]  # ("call", position) or ("attr", target within the block)


@dataclass
class _Block:
    """One captured copy: its operators in order and its tensors by relative target."""

    calls: list[fx.Node] = field(default_factory=list)
    attrs: dict[str, fx.Node] = field(default_factory=dict)

    def node(self, key: Key) -> fx.Node:
        kind, at = key
        return self.calls[at] if kind == "call" else self.attrs[at]


class _Mismatch(Exception):
    """The shortened capture does not show one block repeated."""


def capture_repeated_once(
    model: nn.Module, example_inputs: Any, example_kwargs: Any = None, **options: Any
) -> Captured:
    """`capture(model, example_inputs, example_kwargs, **options)`, tracing the main
    repeated stack's first `KEPT` blocks alone and building the rest of the graph from
    them; the whole model traced where it has no such stack or its blocks do not line
    up."""
    stack = main_stack(model)
    if stack is not None:
        with shortened(model, stack):
            short = capture(model, example_inputs, example_kwargs, **options)
        full = expanded(short, model, stack)
        if full is not None:
            return full
        log.info("the blocks of %s do not line up: capturing every one", stack.path)
    return capture(model, example_inputs, example_kwargs, **options)


def expanded(short: Captured, model: nn.Module, stack: Stack) -> Captured | None:
    """`short` (a capture of `model` with `stack` cut to `KEPT` blocks) as the capture
    of the whole `model`; None where the blocks do not line up."""
    try:
        gm = _expand(short.gm, model, stack)
    except _Mismatch:
        return None
    return Captured(
        gm,
        short.frontend,
        short.example_args,
        short.example_kwargs,
        short.dims,
        short.symbols,
        short.dim_ranges,
    )


def _expand(short: fx.GraphModule, model: nn.Module, stack: Stack) -> fx.GraphModule:
    module_path_pass(short, None)  # type: ignore[arg-type]  # it reads no context
    blocks, owner = _blocks(short, stack)
    template = blocks[-1]
    refs = {n: _reference(n, blocks, owner) for n in template.calls}
    _check_rule(blocks, refs)
    graph = fx.Graph()
    graph._codegen = copy.deepcopy(short.graph._codegen)
    env: dict[fx.Node, fx.Node] = {}
    copies: list[_Block] = []
    last_attr = max(template.attrs.values(), key=_order(short), default=None)
    after = False  # past the stack: what reads the last captured block reads the last copy

    def read(arg: fx.Node) -> fx.Node:
        if after and owner.get(arg, -1) in range(1, KEPT - 1):
            raise _Mismatch(f"{arg.name}, inside the stack, is read after it")
        return env[arg]

    for node in short.graph.nodes:
        env[node] = graph.node_copy(node, read)
        if node is last_attr:
            copies = [_copied_attrs(graph, template, stack, i) for i in range(KEPT, stack.length)]
        if node is template.calls[-1]:
            if len(copies) != stack.length - KEPT:
                raise _Mismatch("the blocks' tensors come after their operators")
            previous = _Block([env[n] for n in template.calls])
            previous.attrs = {k: env[v] for k, v in template.attrs.items()}
            for i, block in enumerate(copies):
                _copy_calls(graph, template, refs, previous, block, env, stack.renamer(KEPT + i))
                previous = block
            env.update(zip(template.calls, previous.calls))
            env.update((v, previous.attrs[k]) for k, v in template.attrs.items())
            after = True
    # Planning reads the graph and never runs it: its Python code is generated on
    # first use, not here.
    gm = _LazyGraphModule(_with_tensors(short, model, copies), graph)
    gm.meta.update(short.meta)
    return gm


def _order(gm: fx.GraphModule) -> Callable[[fx.Node], int]:
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    return position.__getitem__


def _blocks(gm: fx.GraphModule, stack: Stack) -> tuple[list[_Block], dict[fx.Node, int]]:
    """The captured copies, and the copy each of their nodes belongs to. The copies'
    operators must run one block after another, nothing else between them."""
    blocks = [_Block() for _ in range(KEPT)]
    owner: dict[fx.Node, int] = {}
    prefixes = [stack.block(i) for i in range(KEPT)]
    sequence: list[int | None] = []
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            for i, prefix in enumerate(prefixes):
                if str(node.target).startswith(prefix + "."):
                    blocks[i].attrs[str(node.target)[len(prefix) :]] = node
                    owner[node] = i
        elif node.op in _CALLS:
            path = f"{MODULE_PATH.get(node)}."
            found = next((i for i, p in enumerate(prefixes) if path.startswith(p + ".")), None)
            if found is not None:
                blocks[found].calls.append(node)
                owner[node] = found
            sequence.append(found)
    inside = [i for i in sequence if i is not None]
    if not inside or inside != sorted(inside):
        raise _Mismatch("the blocks' operators interleave")
    first = sequence.index(0) if 0 in sequence else -1
    last = len(sequence) - 1 - sequence[::-1].index(KEPT - 1)
    if None in sequence[first : last + 1] or any(not b.calls for b in blocks):
        raise _Mismatch("operators outside the blocks run between them")
    template, middle = blocks[-1], blocks[-2]
    if len(template.calls) != len(middle.calls) or template.attrs.keys() != middle.attrs.keys():
        raise _Mismatch("the blocks differ")
    for node in template.calls:
        if free_unbacked_symbols(node.meta.get("val")):
            raise _Mismatch("a data-dependent size: each block has its own")
    for node in template.attrs.values():
        if not isinstance(node.meta.get("val"), torch.Tensor):
            raise _Mismatch("a block holds a submodule the graph calls")
    return blocks, owner


def _reference(
    node: fx.Node, blocks: list[_Block], owner: dict[fx.Node, int]
) -> list[tuple[str, Any]]:
    """What each input of a template operator is: ("own", key), ("previous", key), or
    ("shared", node) computed once outside the repeated part."""
    out: list[tuple[str, Any]] = []
    for arg in node.all_input_nodes:
        block = owner.get(arg)
        if block == KEPT - 1:
            out.append(("own", _key(arg, blocks[block])))
        elif block == KEPT - 2:
            out.append(("previous", _key(arg, blocks[block])))
        else:
            out.append(("shared", arg))
    return out


def _key(node: fx.Node, block: _Block) -> Key:
    if node.op == "get_attr":
        return ("attr", next(k for k, v in block.attrs.items() if v is node))
    return ("call", block.calls.index(node))


def _resolve(ref: tuple[str, Any], own: _Block, previous: _Block) -> fx.Node:
    kind, at = ref
    if kind == "own":
        return own.node(at)
    if kind == "previous":
        return previous.node(at)
    return at


def _check_rule(blocks: list[_Block], refs: dict[fx.Node, list]) -> None:
    """The middle block is the template read against the first block: the same
    operators with the same arguments, position by position."""
    middle, first = blocks[-2], blocks[-3]
    for template, node in zip(blocks[-1].calls, middle.calls):
        inputs = [_resolve(r, middle, first) for r in refs[template]]
        if node.target != template.target or inputs != node.all_input_nodes:
            raise _Mismatch(f"{node.name} is not a copy of {template.name}")
        substitute = dict(zip(template.all_input_nodes, inputs))
        if fx.map_arg((template.args, template.kwargs), substitute.__getitem__) != (
            node.args,
            node.kwargs,
        ):
            raise _Mismatch(f"{node.name}'s arguments differ from {template.name}'s")
        if _shape(template) != _shape(node):
            raise _Mismatch(f"{node.name}'s shape differs from {template.name}'s")


def _shape(node: fx.Node) -> Any:
    val = node.meta.get("val")
    return (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else type(val)


def _copied_attrs(graph: fx.Graph, template: _Block, stack: Stack, index: int) -> _Block:
    block = _Block()
    for relative, node in template.attrs.items():
        target = f"{stack.block(index)}{relative}"
        new = graph.create_node("get_attr", target, name=target.replace(".", "_"))
        new.meta = copy.copy(node.meta)
        block.attrs[relative] = new
    return block


def _copy_calls(
    graph: fx.Graph,
    template: _Block,
    refs: dict[fx.Node, list],
    previous: _Block,
    block: _Block,
    env: dict[fx.Node, fx.Node],
    rename: Callable[[str], str],
) -> None:
    """The template's operators again, reading `previous` and `block`'s own tensors,
    under the module path of `block` (`rename`)."""
    for node in template.calls:
        inputs = [
            env[r[1]] if r[0] == "shared" else _resolve(r, block, previous) for r in refs[node]
        ]
        substitute = dict(zip(node.all_input_nodes, inputs))
        new = graph.node_copy(node, substitute.__getitem__)
        new.meta.pop(MODULE_PATH.key, None)  # the template's: analysis finds its own
        modules = node.meta.get("nn_module_stack")
        if modules:
            new.meta["nn_module_stack"] = {
                rename(k): (rename(path), kind) for k, (path, kind) in modules.items()
            }
        block.calls.append(new)


def _with_tensors(short: fx.GraphModule, model: nn.Module, copies: list[_Block]) -> nn.Module:
    """`short` holding the copies' own parameters and buffers, taken from `model`, at
    the targets the copies' get_attr nodes read."""
    for block in copies:
        for node in block.attrs.values():
            target = str(node.target)
            path, _, name = target.rpartition(".")
            tensor = getattr(model.get_submodule(path), name, None)
            if not isinstance(tensor, torch.Tensor):
                raise _Mismatch(f"{target} is not a tensor of the model")
            holder = short
            for part in path.split(".") if path else ():
                if not hasattr(holder, part):
                    holder.add_module(part, nn.Module())
                holder = getattr(holder, part)
            if isinstance(tensor, nn.Parameter):
                holder.register_parameter(name, tensor)
            else:
                holder.register_buffer(name, tensor)
    return short
