"""Choosing tensor-parallel placements: Megatron-style column/row pairs, found by
dataflow rather than by layer names.

Linear layers that read the same activation form a candidate group (q, k and v read the
normed hidden state; gate and up read it in an MLP). A group is tried column-parallel;
propagation then reaches the products that consume its sharded output, which become
row-parallel. The trial is kept only if it adds no fallback (an op that would have to
replicate a sharded value), so the choice never trades a clean layout for a gather.
Groups are tried on the first copy of each repeated block, and the decision is copied
to the other copies; a final propagation checks the whole graph.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from torch import fx
from torch.distributed.tensor import Placement, Shard

from autopart.ops.aten import op_name
from autopart.ops.meta import BLOCK
from autopart.passes.tp_propagate import propagate

log = logging.getLogger("autopart.solver")

_OPERANDS = {"linear": (0, 1, 2), "addmm": (1, 2, 0), "mm": (0, 1, None)}  # x, w, bias


def choose_tp_placements(
    gm: fx.GraphModule, param_names: Mapping[str, str], tp: int
) -> dict[str, Placement]:
    """FQN -> tp placement for every parameter that should be sharded."""
    places: dict[str, Placement] = {}
    baseline = len(propagate(gm, param_names, places, tp).fallbacks)
    for group in _candidate_groups(gm, param_names):
        trial = dict(places)
        for op, weight, bias in group:
            column = 0 if op == "linear" else 1
            if not _divisible(gm, weight, column, tp):
                break
            trial[weight] = Shard(column)
            if bias:
                trial[bias] = Shard(0)
        else:
            paired = _with_row_partners(gm, param_names, trial, tp)
            if paired is not None:
                fallbacks = len(propagate(gm, param_names, paired, tp).fallbacks)
                if fallbacks <= baseline:
                    places, baseline = paired, fallbacks
    places = _copy_to_repeated_blocks(gm, places)
    log.debug("tp=%d shards %d parameters", tp, len(places))
    return places


def _with_row_partners(gm, param_names, trial, tp) -> dict[str, Placement] | None:
    result = propagate(gm, param_names, trial, tp)
    for fqn, dim in result.wants_row.items():
        if not _divisible(gm, fqn, dim, tp):
            return None
        trial[fqn] = Shard(dim)
    if not result.wants_row:
        return None  # a column group with no row partner only moves the gather later
    return trial


def _candidate_groups(gm: fx.GraphModule, param_names: Mapping[str, str]):
    """Products with a parameter weight, grouped by the activation they read, in graph
    order; only the first copy of each repeated block."""
    groups: dict[fx.Node, list[tuple[str, str, str | None]]] = {}
    seen_blocks: dict[str, str] = {}
    for node in gm.graph.nodes:
        name = op_name(node, gm)
        if name not in _OPERANDS or node.op != "call_function":
            continue
        block = BLOCK.get(node)
        if block is not None and seen_blocks.setdefault(block.block_id, block.instance) != (
            block.instance
        ):
            continue
        x_i, w_i, b_i = _OPERANDS[name]
        weight = _param(node.args[w_i], param_names)
        if weight is None:
            continue
        has_bias = b_i is not None and len(node.args) > b_i
        bias = _param(node.args[b_i], param_names) if has_bias else None
        groups.setdefault(node.args[x_i], []).append((name, weight, bias))
    return list(groups.values())


def _param(arg: object, param_names: Mapping[str, str]) -> str | None:
    if isinstance(arg, fx.Node) and arg.op == "get_attr":
        return param_names.get(str(arg.target))
    return None


def _divisible(gm: fx.GraphModule, fqn: str, dim: int, tp: int) -> bool:
    return gm.get_parameter(fqn).shape[dim] % tp == 0


def _copy_to_repeated_blocks(
    gm: fx.GraphModule, places: dict[str, Placement]
) -> dict[str, Placement]:
    """Give every copy of a repeated block the placements chosen for its first copy."""
    instances: dict[str, list[str]] = {}
    for node in gm.graph.nodes:
        block = BLOCK.get(node)
        if block is not None and block.instance not in instances.get(block.block_id, []):
            instances.setdefault(block.block_id, []).append(block.instance)
    out = dict(places)
    for members in instances.values():
        first = members[0] + "."
        for fqn, place in places.items():
            if fqn.startswith(first):
                for other in members[1:]:
                    out[other + "." + fqn[len(first) :]] = place
    return out
