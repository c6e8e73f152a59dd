"""Finding a graph's routed expert layers, for expert parallelism and its cost terms.

A mixture-of-experts layer, as Hugging Face's grouped-matrix-multiply experts (and
`torch._grouped_mm`) compute it, sorts its (token, chosen expert) rows by expert and
multiplies them by weights stacked over the experts, [E, in, out], each run of rows by
its own expert's matrix, the runs ending at cumulative `offsets`:

    rows (sorted) ──grouped_mm(W1, offsets)──> per-row ops ──grouped_mm(W2, offsets)──> out

An `ExpertLayer` is one such segment: the grouped multiplies that share one `offsets`,
the stacked weights they read, and what lies between them, which must act on each row
alone (activations, products of rows, a split of the last dim) so that the rows can be
computed anywhere, in any order. A segment that reads anything else in between is not
an expert layer here, and expert parallelism leaves it alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import fx

from autopart.ops.aten import GROUPED_MM_OPS, VIEW_OPS, op_name

# Operators between two grouped multiplies that act on each row alone.
_ROW_WISE = frozenset(
    {
        "getitem",
        "chunk",
        "split",
        "silu",
        "gelu",
        "relu",
        "sigmoid",
        "tanh",
        "mul",
        "add",
        "sub",
        "to",
        "_to_copy",
    }
)

# Readers that only check what they read (torch.export's metadata assertions).
_CHECKS = frozenset({"_assert_tensor_metadata", "_assert_scalar"})


@dataclass(frozen=True)
class ExpertLayer:
    """One routed layer: its grouped multiplies (`entries` read the routed rows,
    `exits` produce the layer's rows), the `offsets` they share, the FQNs of the stacked
    expert weights, the number of experts, and the row-wise operators between the
    multiplies (`inside`)."""

    offsets: fx.Node
    matmuls: tuple[fx.Node, ...]
    entries: tuple[fx.Node, ...]
    exits: tuple[fx.Node, ...]
    params: tuple[str, ...]
    experts: int
    inside: frozenset[fx.Node]


def expert_layers(gm: fx.GraphModule, params: Mapping[str, str]) -> list[ExpertLayer]:
    """The graph's expert layers, in graph order (`params`: attribute path -> FQN)."""
    by_offsets: dict[fx.Node, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if op_name(node, gm) in GROUPED_MM_OPS and len(node.args) >= 2:
            offsets = node.args[2] if len(node.args) > 2 else node.kwargs.get("offs")
            if isinstance(offsets, fx.Node):
                by_offsets.setdefault(offsets, []).append(node)
    layers = []
    for offsets, matmuls in by_offsets.items():
        layer = _layer(gm, offsets, matmuls, params)
        if layer is not None:
            layers.append(layer)
    return layers


def _layer(
    gm: fx.GraphModule, offsets: fx.Node, matmuls: list[fx.Node], params: Mapping[str, str]
) -> ExpertLayer | None:
    weights = [_stacked_weight(gm, mm.args[1], params) for mm in matmuls]
    if any(w is None for w in weights):
        return None
    fqns = tuple(dict.fromkeys(fqn for fqn, _ in weights if fqn))  # type: ignore[misc]
    experts = {e for _, e in weights}  # type: ignore[misc]
    if len(experts) != 1:
        return None
    inside = _between(matmuls)
    if inside is None:
        return None
    members = inside | set(matmuls)
    entries = tuple(mm for mm in matmuls if mm.args[0] not in members)
    exits = tuple(mm for mm in matmuls if not any(u in members for u in mm.users))
    return ExpertLayer(
        offsets, tuple(matmuls), entries, exits, fqns, experts.pop(), frozenset(inside)
    )


def _stacked_weight(
    gm: fx.GraphModule, weight: object, params: Mapping[str, str]
) -> tuple[str, int] | None:
    """(FQN, number of experts) of the stacked parameter a grouped multiply's weight
    views, or None where it is not one."""
    node = weight
    while isinstance(node, fx.Node) and node.op == "call_function":
        if op_name(node, gm) not in VIEW_OPS | {"to", "_to_copy"}:
            return None
        node = node.args[0]
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    fqn = params.get(str(node.target))
    if fqn is None:
        return None
    value = gm.get_parameter(str(node.target))
    return (fqn, value.shape[0]) if value.dim() == 3 else None


def _between(matmuls: list[fx.Node]) -> set[fx.Node] | None:
    """The nodes on the paths from one of the grouped multiplies to another, or None
    where one of them is not row-wise, reads a tensor from outside the segment, or is
    read from outside it."""
    members = set(matmuls)
    inside = _walk(matmuls, lambda n: n.users) & _walk(matmuls, lambda n: n.all_input_nodes)
    for node in inside:
        if op_name(node) not in _ROW_WISE or not _splits_last_dim(node):
            return None
        if any(a not in inside and a not in members for a in node.all_input_nodes):
            return None
        outside = [u for u in node.users if u not in inside and u not in members]
        if any(op_name(u) not in _CHECKS for u in outside):
            return None
    return inside


def _walk(starts: list[fx.Node], step: Callable[[fx.Node], Iterable[fx.Node]]) -> set[fx.Node]:
    """The nodes reachable from `starts` (not themselves) along `step`."""
    seen: set[fx.Node] = set()
    excluded = set(starts)
    frontier = [n for s in starts for n in step(s)]
    while frontier:
        node = frontier.pop()
        if node not in seen and node not in excluded:
            seen.add(node)
            frontier.extend(step(node))
    return seen


def _splits_last_dim(node: fx.Node) -> bool:
    """A chunk or split cuts each row (the last dim), not the rows; other ops pass."""
    if op_name(node) not in ("chunk", "split"):
        return True
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    source = node.args[0]
    value = source.meta.get("val") if isinstance(source, fx.Node) else None
    last = value.dim() - 1 if isinstance(value, torch.Tensor) else -1
    return isinstance(dim, int) and dim in (-1, last)
