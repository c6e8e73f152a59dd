"""Which operand of each batch × batch product gives the rows of what the model returns
from it: the side a replica keeps its own of where the loss is a mean over those rows
(`Plan.batch_product_loss` "rows", passes/batch_products.py). Each replica then
gathers only the other side, the columns, and scores its own rows against every
column.

CLIP's image × caption scores are `captions @ images.T` in Hugging Face's model,
returned transposed as `logits_per_image`: the rows the loss reads are the images', the
product's second operand. No rule over operators tells that apart in general, so the
products and what is computed from them run once per choice of sides on the meta
device, each side's batch a size of its own (`ROWS`, `COLUMNS`): the choice under which
every output computed from them leads with the rows' size is the one.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from autopart.ops.meta import SHAPE, TensorInfo
from autopart.passes.batch_mixing import computed_from, gathered_products, product_operands

# Batch sizes for the rows' side and the columns' (distinct primes, so that no other
# dim takes them for either).
ROWS, COLUMNS = 1009, 1013
# Choices of sides tried at most (two per product).
_MOST_PRODUCTS = 4


def row_operands(gm: fx.GraphModule) -> dict[fx.Node, fx.Node] | None:
    """Each batch × batch product the batch-products rewrite gathers
    (`gathered_products`) with its operand that gives the rows of every output computed
    from it; None where the outputs' rows come from no one choice of sides (the rewrite
    then gathers both and keeps its rows of the whole). Needs the shape analysis."""
    products = gathered_products(gm)
    if not products:
        return {}
    operands = [[a for a, _ in product_operands(p)] for p in products]
    if len(products) > _MOST_PRODUCTS or any(len(o) != 2 for o in operands):
        return None
    carried = computed_from(products)
    nodes = [n for n in gm.graph.nodes if n in carried]
    (output,) = gm.graph.find_nodes(op="output")
    leaves = [x for x in pytree.tree_leaves(output.args[0]) if x in carried]
    for choice in itertools.product(*operands):
        rows = dict(zip(products, choice, strict=True))
        if leaves and _rows_lead(nodes, leaves, rows):
            return rows
    return None


def _rows_lead(nodes: list[fx.Node], leaves: list[fx.Node], rows: dict[fx.Node, fx.Node]) -> bool:
    """Whether every one of `leaves` leads with the rows' size when `nodes` run on the
    meta device, each product's operand in `rows` sized `ROWS` in its batch dim and the
    other `COLUMNS`."""
    values: dict[fx.Node, Any] = {}
    try:
        for node in nodes:
            sized = {
                a: _meta(a, dim, ROWS if a is rows.get(node) else COLUMNS)
                for a, dim in (product_operands(node) if node in rows else ())
            }

            def value(a: fx.Node, sized: dict[fx.Node, Any] = sized) -> Any:
                if a in sized:
                    return sized[a]
                return values[a] if a in values else _meta(a, None, 0)

            args, kwargs = fx.node.map_arg((node.args, node.kwargs), value)
            values[node] = node.target(*args, **kwargs)  # type: ignore[operator]
    except Exception:  # noqa: BLE001 - an operator the meta device cannot run: no choice
        return False
    found = [values[leaf] for leaf in leaves]
    return all(isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == ROWS for x in found)


def _meta(node: fx.Node, dim: int | None, size: int) -> Any:
    """A meta tensor shaped as `node`'s, `size` in its batch `dim`; a constant as it is.
    Raises where a size is not a number (another dynamic dim)."""
    info = SHAPE.get(node, None)
    if not isinstance(info, TensorInfo):
        value = node.meta.get("val")
        if isinstance(value, int | float | bool):
            return value
        raise TypeError(f"{node.name}: no single tensor or constant")
    shape = [size if d == dim else int(s) for d, s in enumerate(info.shape)]
    return torch.empty(shape, dtype=info.dtype, device="meta")
