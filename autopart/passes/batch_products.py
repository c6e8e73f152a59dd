"""Batch × batch products under a split of the batch over replicas (dp × ep, the batch
group): the rewrite that makes a model such as CLIP, which scores every image against
every caption of the batch, exact where each replica holds a part of the batch.

What each replica gathers, with `collectives.gather_for_grad` (all-gather forward,
reduce-scatter backward, so each embedding's gradient comes back to the replica that
computed it), follows what the loss reads (`Plan.batch_product_loss`,
ops/batch_products.py):

- "rows", a loss that is a mean over the product's rows: each product gathers only its
  columns' side (`product_rows.row_operands`), so each replica scores its own rows
  against every column, and the loss runs on them with its own part of the target, as
  for any other output. Where no one side gives the rows of every output computed from
  the products, both sides are gathered and each batched output computed from them
  keeps this replica's rows of the whole (`own_rows`);
- "whole": both sides are gathered, so every replica holds the whole product as one
  device does; every other batched output is gathered as well (along the batch, dim 0),
  and the runtime hands the user's loss the whole target: one device's loss on every
  replica.
"""

from __future__ import annotations

from torch import fx
from torch.utils import _pytree as pytree

from autopart.degrees import BATCH_AXES
from autopart.ops import collectives as c
from autopart.ops.batch_products import ROWS, own_rows
from autopart.ops.meta import COLLECTIVE, SHAPE, CollectiveInfo, inherit, tensor_info
from autopart.passes.batch_mixing import batched, computed_from, gathered_products, product_operands
from autopart.passes.product_rows import row_operands
from autopart.passes.runner import PassContext
from autopart.plan import Plan


def splits_products(plan: Plan) -> bool:
    """Whether the plan splits the batch over replicas; the pass finds the products."""
    return plan.degrees.batch_split > 1


def batch_products_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    products = gathered_products(gm)
    if not products:
        return gm
    groups = ctx.rank.groups
    group = groups.batch_group().group_name
    axes = " × ".join(str(a) for a in BATCH_AXES if groups.size(a) > 1)
    rows = ctx.rank.plan.batch_product_loss == ROWS
    kept = row_operands(gm) if rows else None
    for product in products:
        for operand, dim in dict(product_operands(product)).items():
            if kept and kept[product] is operand:
                continue  # this replica's own rows
            gathered = _insert(gm, c.gather_for_grad, (operand, dim, group), product, operand)
            COLLECTIVE.set(gathered, CollectiveInfo("all_gather", axes, group, _nbytes(operand)))
            product.replace_input_with(operand, gathered)
    if not kept:  # else each output computed from the products holds this replica's rows
        _match_outputs(gm, products, rows, group, axes)
    gm.graph.lint()
    gm.recompile()
    return gm


def _match_outputs(
    gm: fx.GraphModule, products: list[fx.Node], rows: bool, group: str, axes: str
) -> None:
    """Where both sides of the products are gathered: under a loss over the rows, each
    batched output computed from them keeps this replica's rows; under the whole, every
    other batched output is gathered too."""
    carried = computed_from(products)
    (output,) = gm.graph.find_nodes(op="output")
    for leaf in pytree.tree_leaves(output.args[0]):
        at = _batch_dim(leaf)
        if at is None or (leaf in carried) != rows:
            continue
        if rows:
            part = _insert(gm, own_rows, (leaf, group), output, leaf)
        else:
            part = _insert(gm, c.gather_for_grad, (leaf, at, group), output, leaf)
            COLLECTIVE.set(part, CollectiveInfo("all_gather", axes, group, _nbytes(leaf)))
        output.replace_input_with(leaf, part)


def _insert(gm: fx.GraphModule, fn: object, args: tuple, before: fx.Node, like: fx.Node) -> fx.Node:
    with gm.graph.inserting_before(before):
        node = gm.graph.call_function(fn, args)  # type: ignore[arg-type]
    inherit(node, like, SHAPE.get(like))
    return node


def _batch_dim(leaf: object) -> int | None:
    """The first dim of an output leaf sized by the batch, or None."""
    if not isinstance(leaf, fx.Node) or not SHAPE.has(leaf):
        return None
    info = SHAPE.get(leaf)
    dims = [d for d, size in enumerate(getattr(info, "shape", ())) if batched(size)]
    return dims[0] if dims else None


def _nbytes(node: fx.Node) -> object:
    return tensor_info(node).nbytes
