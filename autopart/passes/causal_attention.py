"""Causal attention: give attention its `is_causal` flag back.

Traced, a Hugging Face decoder builds its causal mask out of aranges and comparisons and
hands it to `scaled_dot_product_attention` as an explicit `attn_mask`, where the eager
model passes `is_causal=True` and no mask. The results agree, but an explicit mask rules
out the flash kernels, which are faster and what the eager model runs.

For each attention with a mask, the mask's ancestry is evaluated on the example inputs
and again on inputs with other values (same shapes): a mask that is the lower-triangular
causal pattern both times depends on shapes alone, and is replaced by `is_causal=True`.
A mask that depends on the data (padding) is left alone.

Where a mask cannot be evaluated (on the meta device, or over a long sequence), the cost
models take one in that plain form computed from shapes alone as causal
(`shape_only_mask`, `runs_causal`): what this pass would make of a Hugging Face
decoder's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from autopart.ops.aten import ATTENTION_OPS, op_name
from autopart.ops.context_parallel import attention_arguments
from autopart.passes.runner import PassContext

MASK_ARG = 3
# Readers of a tensor that read its shape, dtype or device alone, not its values.
SHAPE_READS = frozenset(
    {
        "sym_size",
        "sym_numel",
        "sym_stride",
        "size",
        "dim",
        "numel",
        "new_ones",
        "new_zeros",
        "new_empty",
        "new_full",
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
    }
)


def causal_attention_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    args = ctx.example_args
    if args is None:
        return gm
    changed = False
    for node in gm.graph.nodes:
        mask = plain_mask(gm, node)
        if mask is not None and _is_causal(gm, mask, args):
            node.args = node.args[:MASK_ARG]
            node.kwargs = {**node.kwargs, "is_causal": True}
            changed = True
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return gm


def plain_mask(gm: fx.GraphModule, node: fx.Node) -> fx.Node | None:
    """The mask of `node` where it is attention in the plain (q, k, v, mask) form, the
    one this pass rewrites (no dropout, no other argument), else None."""
    if op_name(node, gm) not in ATTENTION_OPS or len(node.args) != MASK_ARG + 1:
        return None
    mask = node.args[MASK_ARG]
    return mask if isinstance(mask, fx.Node) and "dropout_p" not in node.kwargs else None


def shape_only_mask(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether `node` is attention in the plain (q, k, v, mask) form this pass
    evaluates, with a mask computed from shapes alone: no parameter among what it is
    computed from, and no input read but for its sizes (the input is not the mask)."""
    mask = plain_mask(gm, node)
    if mask is None:
        return False
    ancestry = _computed_from(mask)
    if _reads_parameters(gm, ancestry):
        return False
    for n in ancestry:
        if n.op == "placeholder" and (
            n is mask or any(u in ancestry and op_name(u, gm) not in SHAPE_READS for u in n.users)
        ):
            return False
    return True


def runs_causal(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether attention `node` runs causal as far as can be told without evaluating a
    mask: `is_causal=True` among its arguments, or a mask computed from shapes alone
    (`shape_only_mask`)."""
    named = attention_arguments(node.args[3:], node.kwargs)
    if named is not None and named["is_causal"] is True:
        return True
    return shape_only_mask(gm, node)


def _computed_from(node: fx.Node) -> set[fx.Node]:
    """`node` and every node it is computed from."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _is_causal(gm: fx.GraphModule, mask: fx.Node, args: tuple) -> bool:
    sub = _ancestry(gm, mask)
    if sub is None:
        return False
    try:
        with torch.no_grad():
            return all(_is_lower_triangular(sub(*a)) for a in (args, _other_values(args)))
    except Exception:  # noqa: BLE001 - a mask we cannot evaluate (meta inputs) stays
        return False


def _ancestry(gm: fx.GraphModule, target: fx.Node) -> fx.GraphModule | None:
    """A graph computing `target` from the graph's inputs; None if it reads parameters."""
    needed = _computed_from(target)
    if _reads_parameters(gm, needed):
        return None
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder" or node in needed:
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(env[target])
    return fx.GraphModule(gm, graph)


def _reads_parameters(gm: fx.GraphModule, nodes: set[fx.Node]) -> bool:
    return any(n.op == "get_attr" and isinstance(_attr(gm, n), torch.nn.Parameter) for n in nodes)


def _attr(gm: fx.GraphModule, node: fx.Node) -> Any:
    owner, _, name = str(node.target).rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name)


def _other_values(args: tuple) -> tuple:
    def perturb(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.is_meta:
            return x
        if x.dtype == torch.bool:
            return ~x
        return (x + 1) if not x.is_floating_point() else torch.randn_like(x)

    return pytree.tree_map(perturb, args)


def _is_lower_triangular(mask: Any) -> bool:
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2 or mask.shape[-1] != mask.shape[-2]:
        return False
    allowed = mask if mask.dtype == torch.bool else mask == 0  # additive masks use 0 / -inf
    causal = torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device).tril()
    return bool((allowed == causal).all())
