"""Repeated blocks: structurally identical copies of a module (transformer layers).

Candidates are the children of a container indexed by integers (`model.layers.3`).
Each candidate's operators form a small graph, labelled by operator, output shapes and
parameter names relative to the block (data-dependent sizes renamed in order, so that
two mixture-of-experts layers compare equal); networkx's Weisfeiler-Lehman hash names
its structure. Copies with the same hash under the same container share a `block_id`, so
the solver can decide once per structure and the cost models can price one copy. The
children of the model's main stack (the container with the most children) are blocks
even when they are not copies: each unlike one is a kind of its own, so that pipeline
cuts can fall between any two layers.
"""

from __future__ import annotations

import re
import warnings
from collections import defaultdict

import networkx as nx
from torch import fx

from autopart.ops.aten import op_name
from autopart.ops.meta import BLOCK, MODULE_PATH, PARAMS, SHAPE, BlockInfo, TensorInfo
from autopart.passes.runner import PassContext

_INDEXED = re.compile(r"^(?P<container>.+?)\.(?P<index>\d+)(?:\.|$)")
# A data-dependent size (a routed expert's token count): each layer's gets its own name
# (u0, u1, ...), so copies are compared with their own names in order of appearance.
_UNBACKED = re.compile(r"\bu\d+\b")


def blocks_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    instances: dict[str, list[fx.Node]] = defaultdict(list)
    instance_of: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        match = _INDEXED.match(MODULE_PATH.get(node)) if node.op != "get_attr" else None
        if match:
            instance_of[node] = f"{match['container']}.{match['index']}"
            instances[instance_of[node]].append(node)

    by_structure: dict[tuple[str, str], list[str]] = defaultdict(list)
    children: dict[str, int] = defaultdict(int)
    for instance, nodes in instances.items():
        container = instance.rpartition(".")[0]
        by_structure[(container, _structure_hash(gm, instance, nodes))].append(instance)
        children[container] += 1
    # The model's main stacks (the containers with the most children): every child is a
    # block, copies of one another or not, so that unlike layers (alternating attention,
    # dense and expert layers) can still be cut into pipeline stages.
    most = max(children.values(), default=0)
    stacks = {c for c, n in children.items() if n == most}

    info: dict[str, BlockInfo] = {}
    for kind, ((container, _), members) in enumerate(sorted(by_structure.items())):
        if len(members) < 2 and container not in stacks:
            continue
        block_id = f"{container}#{kind}"
        for instance in members:
            info[instance] = BlockInfo(block_id, instance, int(instance.rpartition(".")[2]))

    for node in gm.graph.nodes:
        BLOCK.set(node, info.get(instance_of.get(node, "")))
    return gm


def _structure_hash(gm: fx.GraphModule, instance: str, nodes: list[fx.Node]) -> str:
    # Size arithmetic (no tensor) does no work, and the first layer that needs a size
    # computes it for all: it is not part of a layer's structure.
    nodes = [n for n in nodes if isinstance(SHAPE.get(n), TensorInfo)]
    inside = set(nodes)
    graph = nx.DiGraph()
    unbacked: dict[str, str] = {}
    for node in nodes:
        relative_params = ",".join(p.removeprefix(instance) for p in PARAMS.get(node))
        shape = _UNBACKED.sub(
            lambda m: unbacked.setdefault(m[0], f"u#{len(unbacked)}"), str(SHAPE.get(node))
        )
        graph.add_node(node.name, label=f"{op_name(node, gm)}|{shape}|{relative_params}")
        for arg in node.all_input_nodes:
            if arg in inside:
                graph.add_edge(arg.name, node.name)
    with warnings.catch_warnings():  # networkx notes its directed hashes changed in 3.5
        warnings.simplefilter("ignore", UserWarning)
        return nx.weisfeiler_lehman_graph_hash(graph, node_attr="label")


def block_counterparts(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """Each tensor-producing node of a later copy of a repeated block -> the node at the
    same position in the block's first copy (copies whose operators and shapes line up
    position by position; `blocks_pass` first)."""
    instances: dict[str, dict[str, list[fx.Node]]] = defaultdict(dict)
    for node in gm.graph.nodes:
        block = BLOCK.get(node)
        if block is not None and isinstance(SHAPE.get(node, None), TensorInfo | tuple):
            instances[block.block_id].setdefault(block.instance, []).append(node)
    out: dict[fx.Node, fx.Node] = {}
    for members in instances.values():
        first, *others = members.values()
        for nodes in others:
            # Copies hash alike (operators, shapes, relative parameters); the same
            # operator at every position confirms they are also laid out alike.
            if len(nodes) == len(first) and all(a.target == b.target for a, b in zip(first, nodes)):
                out.update(zip(nodes, first))
    return out
