"""Recognizing a standard cross-entropy among the loss functions users pass.

`parallelize(..., loss_fn=...)` takes any callable. Where it is the mean cross-entropy
of one of the model's outputs over its last dim (the logits), the loss can run on logits
sharded over the vocabulary (ops/vocab_parallel_loss.py) instead of gathering them. The
spelling does not matter: `loss_fn` is traced by `make_fx` on meta tensors shaped as the
captured graph's outputs, and the ATen graph it records is matched, so
`F.cross_entropy(out.logits.flatten(0, 1), target.flatten())`, `.view(-1, V)`,
`nn.CrossEntropyLoss()`, `output["logits"]` or `output[0]` all come out alike:

    logits leaf ── views ── _log_softmax(dim=-1) ──┐
    target      ── views ──────────────────────────┴─ nll_loss_forward(weight=None,
                                                       reduction=mean) ─ [0] → loss

and nothing else computed. Label smoothing, class weights, a sum reduction, a shifted
target or an extra term each add or change a node, so they do not match and the logits
are gathered for the loss as before. The target is assumed to be class indices shaped
as the logits without their last dim; the runtime checks each step's target against
that before it takes the sharded path (runtime/loss.py).
"""

from __future__ import annotations

import logging
import operator
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

log = logging.getLogger("autopart.loss")

aten = torch.ops.aten

# Ops that only re-view a tensor: row-major element order is kept, so a row of the
# logits stays one row as long as the last dim stays the vocabulary.
_VIEWS = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.unsqueeze.default,
    aten.clone.default,
    aten.alias.default,
}
_MEAN = 1  # torch's Reduction::Mean
# Output leaves tried as the logits: the floating ones of rank >= 2, in order, at most
# this many (each try is one trace of the loss function).
_MAX_TRIES = 4


@dataclass(frozen=True, slots=True)
class CrossEntropy:
    """A loss recognized as `F.cross_entropy(logits.flatten(0, -2), target.flatten(),
    ignore_index=ignore_index)` with the mean reduction, where `logits` is the
    `logits`-th leaf of the model's output (flattened by pytree, as the graph returns
    it) and the target one tensor shaped as the logits without their last dim."""

    logits: int
    ignore_index: int = -100


def match_cross_entropy(
    loss_fn: Callable[[Any, Any], Any], gm: fx.GraphModule
) -> CrossEntropy | None:
    """What `loss_fn(output, target)` is, for the captured `gm`'s output: a standard
    cross-entropy, or None for anything else (or anything that cannot be traced)."""
    leaves = example_outputs(gm)
    if leaves is None:
        return None
    candidates = [
        i
        for i, x in enumerate(leaves)
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() >= 2
    ]
    for i in candidates[:_MAX_TRIES]:
        target = torch.empty(leaves[i].shape[:-1], dtype=torch.long, device="meta")
        graph = _trace(loss_fn, gm, leaves, target)
        found = _match(graph) if graph is not None else None
        if found is not None and found.logits == i:
            log.info("autopart: the loss is a standard cross-entropy of output %d", i)
            return found
    return None


def example_outputs(gm: fx.GraphModule) -> list[Any] | None:
    """The graph's output leaves as meta tensors at the example's sizes (non-tensor
    leaves as they are), or None where a value has no recorded example."""
    (output,) = gm.graph.find_nodes(op="output")
    leaves = []
    for leaf in pytree.tree_leaves(output.args[0]):
        if not isinstance(leaf, fx.Node):
            leaves.append(leaf)
            continue
        val = leaf.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return None
        sizes = [_example_size(s) for s in val.shape]
        shape = [s for s in sizes if s is not None]
        if len(shape) != len(sizes):
            return None
        leaves.append(torch.empty(shape, dtype=val.dtype, device="meta"))
    return leaves


def _example_size(size: int | torch.SymInt) -> int | None:
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        return int(hint) if hint is not None else None
    return int(size)


def _trace(
    loss_fn: Callable[[Any, Any], Any], gm: fx.GraphModule, leaves: list[Any], target: torch.Tensor
) -> fx.Graph | None:
    """The ATen graph of `loss_fn(output, target)`, its placeholders the output's tensor
    leaves in order, then the target; None where tracing fails."""
    (output,) = gm.graph.find_nodes(op="output")
    _, spec = pytree.tree_flatten(output.args[0])
    tensor_at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

    def call(*tensors: torch.Tensor) -> Any:
        flat = list(leaves)
        for i, t in zip(tensor_at, tensors):
            flat[i] = t
        # The structure the model returns (a Hugging Face ModelOutput, a dict, ...).
        model_output = gm.graph.process_outputs(pytree.tree_unflatten(flat, spec))
        return loss_fn(model_output, tensors[-1])

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            traced = make_fx(call, tracing_mode="fake")(*[leaves[i] for i in tensor_at], target)
    except Exception as e:  # noqa: BLE001 - any loss we cannot trace is simply not matched
        log.debug("the loss function could not be traced (%s): logits are gathered", e)
        return None
    # Report leaf indices, not tensor positions: remember which leaf each placeholder is.
    for node, i in zip(traced.graph.find_nodes(op="placeholder"), [*tensor_at, -1]):
        node.meta["autopart.leaf"] = i
    return traced.graph


def _match(graph: fx.Graph) -> CrossEntropy | None:
    """The pattern in the module docstring, with nothing else computed."""
    (output,) = graph.find_nodes(op="output")
    result = output.args[0]
    if not _is(result, operator.getitem) or result.args[1] != 0:
        return None
    nll = result.args[0]
    if not _is(nll, aten.nll_loss_forward.default):
        return None
    log_probs, target, weight, reduction, ignore_index = nll.args
    if weight is not None or reduction != _MEAN or not _is(log_probs, aten._log_softmax.default):
        return None
    logits, dim, half_to_float = log_probs.args
    rows = _val(logits)
    if half_to_float or rows is None or rows.dim() != 2 or dim not in (1, -1):
        return None
    logits_chain = _view_chain(logits, width=rows.shape[-1])
    target_chain = _view_chain(target)
    if logits_chain is None or target_chain is None:
        return None
    source, target_source = logits_chain[-1], target_chain[-1]
    if source.meta.get("autopart.leaf", -1) < 0 or target_source.meta.get("autopart.leaf") != -1:
        return None
    used = {result, nll, log_probs, *logits_chain, *target_chain}
    for node in graph.nodes:
        if node.op == "call_function" and node not in used and not _unused_getitem(node, nll):
            return None  # something else is computed: not the plain cross-entropy
    return CrossEntropy(logits=source.meta["autopart.leaf"], ignore_index=int(ignore_index))


def _view_chain(node: Any, width: int | None = None) -> list[fx.Node] | None:
    """The nodes from `node` back to the placeholder it views, all re-views (keeping
    the last dim `width` where given, and converting at most the dtype); None otherwise."""
    chain = []
    while isinstance(node, fx.Node) and node.op != "placeholder":
        val = _val(node)
        if node.op != "call_function" or val is None:
            return None
        if width is not None and (val.dim() == 0 or val.shape[-1] != width):
            return None
        if node.target not in _VIEWS and not _dtype_cast(node):
            return None
        chain.append(node)
        node = node.args[0]
    if not isinstance(node, fx.Node) or (val := _val(node)) is None:
        return None
    if width is not None and (val.dim() == 0 or val.shape[-1] != width):
        return None
    return [*chain, node]


def _dtype_cast(node: fx.Node) -> bool:
    """`x.float()`: a copy that changes the dtype only (to fp32, where the sharded loss
    computes anyway)."""
    if node.target != aten._to_copy.default or set(node.kwargs) - {"dtype"}:
        return False
    return node.kwargs.get("dtype") in (None, torch.float32)


def _unused_getitem(node: fx.Node, source: fx.Node) -> bool:
    return _is(node, operator.getitem) and node.args[0] is source and not node.users


def _is(node: Any, target: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target == target


def _val(node: fx.Node) -> torch.Tensor | None:
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None
