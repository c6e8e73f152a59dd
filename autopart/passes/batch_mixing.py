"""Operators that mix the examples of a batch, so that splitting the batch (over dp, or
into microbatches) changes what the model computes: each part would see only its own
examples, where one device sees them all.

Four kinds are recognized, from the shapes in the named dims (the shape analysis):

- batch normalization in training mode, whose mean and variance run over the batch;
- an output with two dims sized by the batch, such as CLIP's image × caption scores,
  where every example is scored against every other;
- statistics over the batch combined nonlinearly inside the model: a product or
  quotient of two values each reduced over the batch (or a nonlinear function of one),
  such as a mixture-of-experts load-balancing loss, the fraction of tokens routed to
  each expert times their mean router probability. The parts' products averaged are
  not the product of the whole batch's statistics;
- routing that ranks or counts the batch's rows: a top-k along a dim sized by the batch
  (expert-choice routing: each expert takes the tokens it scores highest among all of
  them), or the first rows of a sort along one, a running sum of floats along one, or
  a row's position among the batch's rows compared with a bound (an expert's
  capacity: it keeps its first C rows and drops the rest). A position (an index of
  `arange` over the rows, a sort's or `nonzero`'s indices, an integer running count)
  is free to move rows, as dropless routing does to group them by expert and back:
  only a comparison, or a slice that keeps the first, makes a row's fate depend on
  the rows before it.

Batch normalization as torch.export captures it (`aten.batch_norm`) is exact under a
split of the batch over replicas once the batch-norm rewrite reduces its statistics over
them (`reduced_over_replicas`, passes/batch_norm.py): the planner asks for those apart
(`norms_over_replicas`), since microbatches within a replica still split what it
normalizes.

Found only where the capture keeps the batch dynamic (the default; not a model captured
on the meta device, whose batch is static). A reduction over the batch that only feeds
the loss linearly (a mean of per-example losses, scaled) is not flagged: the runtime
averages the parts' losses, which is that mean.
"""

from __future__ import annotations

import sympy
import torch
from torch import fx

from autopart.batch import BATCH
from autopart.ops.aten import REDUCTION_OPS, op_name
from autopart.ops.meta import MODULE_PATH, SHAPE, TensorInfo

# Batch normalization as the exporter records it: composite, or one of its lowerings.
_BATCH_NORMS = {
    "batch_norm",
    "native_batch_norm",
    "_native_batch_norm_legit",
    "_native_batch_norm_legit_functional",
    "_batch_norm_with_update",  # always updates its running statistics: training
    "cudnn_batch_norm",
    "miopen_batch_norm",
}


def batch_mixing(
    gm: fx.GraphModule, statistics: bool = True, reduced_norms: bool = True
) -> list[str]:
    """How and where `gm` mixes the examples of its batch, one line per kind ("batch_norm
    in training mode normalizes over the batch, at blocks.0.1, blocks.1.1"); empty
    where the examples are computed apart. Without `statistics`, batch norms,
    statistics combined over the batch and routing over its rows are not counted (the
    user accepts them per part); without `reduced_norms`, the batch norms the batch-norm
    rewrite reduces over the replicas are not. Needs the shape and module-path
    analyses."""
    found: dict[str, dict[str, None]] = {}  # kind -> module paths, ordered, no repeats
    seen: set[fx.Node] = set()  # values reduced over the batch, and what they feed
    ordered: dict[fx.Node, str] = {}  # positions among the batch's rows, sorted rows
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        counted = statistics and (reduced_norms or not reduced_over_replicas(node))
        why = (_normalizes(node) if counted else "") or _mixes(node)
        if not why and statistics:
            why = _combines_statistics(node, seen) or _routes_rows(node, ordered)
        if why:
            found.setdefault(why, {})[_path(node)] = None
    return [f"{why}, at {', '.join(paths)}" for why, paths in found.items()]


def norms_over_replicas(gm: fx.GraphModule) -> list[str]:
    """The batch norms the batch-norm rewrite reduces over the replicas, as
    `batch_mixing` words them: exact under a split over replicas, not over microbatches
    (a replica's first microbatch would be normalized before its last is seen)."""
    paths = {_path(n): None for n in gm.graph.nodes if reduced_over_replicas(n)}
    if not paths:
        return []
    return [f"batch_norm in training mode normalizes over the batch, at {', '.join(paths)}"]


def reduced_over_replicas(node: fx.Node) -> bool:
    """Whether `node` is a batch norm in training mode over the batch, as torch.export
    captures it (`aten.batch_norm`), which the batch-norm rewrite replaces by one over
    the whole batch (ops/batch_norm.py). Its lowerings, which return their saved
    statistics, and a traced module are left as they are, and so split nothing."""
    return node.target is torch.ops.aten.batch_norm.default and bool(_normalizes(node))


def _path(node: fx.Node) -> str:
    return MODULE_PATH.get(node) or "the top level"


# Reductions whose result, taken over the batch, is a statistic of it.
_STATISTICS = REDUCTION_OPS | {"histc", "bincount", "count_nonzero"}
# Operators nonlinear in their one operand.
_NONLINEAR = frozenset(
    {"exp", "log", "pow", "sqrt", "rsqrt", "reciprocal", "square", "softmax", "log_softmax"}
)


def _combines_statistics(node: fx.Node, statistics: set[fx.Node]) -> str:
    """Whether `node` combines statistics over the batch nonlinearly; records in
    `statistics` the values that carry one (reduced over the batch, or computed from
    such a value without the batch)."""
    out = _info(node)
    if out is None or any(map(batched, out.shape)):
        return ""
    inputs = node.all_input_nodes
    reduced = op_name(node) in _STATISTICS and any(
        (info := _info(a)) is not None and any(map(batched, info.shape)) for a in inputs
    )
    carried = [a for a in inputs if a in statistics]
    if reduced or carried:
        statistics.add(node)
    name = op_name(node)
    if (name in ("mul", "div") and len(carried) >= 2) or (name in _NONLINEAR and carried):
        return (
            f"{name} combines statistics over the batch (a load-balancing loss's token "
            "fractions and router probabilities, say) that each part would take over its "
            "own examples"
        )
    return ""


# Ranking along a dim: which rows come out depends on all of them.
_RANKINGS = frozenset({"topk", "kthvalue"})
# Running values along a dim: a row's depends on the rows before it.
_SCANS = frozenset({"cumsum", "cumprod", "cummax", "cummin", "logcumsumexp"})
_COMPARISONS = frozenset(
    {"lt", "le", "gt", "ge", "eq", "ne", "clamp", "clamp_min", "clamp_max", "minimum", "maximum"}
)
_SLICES = frozenset({"slice", "narrow"})
# Operators that read some operands as indices into another (by the schema's argument
# name): what they give carries a position only through the operands they do not index
# with.
_INDEX_ARGUMENTS = frozenset({"indices", "index"})
POSITION, SORTED = "position", "sorted"  # what an `_routes_rows` value carries


def _routes_rows(node: fx.Node, ordered: dict[fx.Node, str]) -> str:
    """Whether `node` ranks the batch's rows, compares a row's position among them with
    a bound, or keeps the first rows of a sort over them; records in `ordered` the
    values that carry a position among the rows (POSITION) or their sorted values
    (SORTED)."""
    name = op_name(node)
    along = _along(node)
    if name in _RANKINGS and along:
        return (
            f"{name} ranks the batch's rows (expert-choice routing, say: each expert "
            "takes the tokens it scores highest among all of them)"
        )
    if name in _SCANS and along:
        out = _info(node)
        if out is not None and out.dtype.is_floating_point:
            return f"{name} runs over the batch's rows, each row's value taking the rows before it"
        ordered[node] = POSITION  # a running count: a row's place among those before it
        return ""
    source = _source_kind(node, along)
    if source:
        ordered[node] = source
        return ""
    kinds = {ordered[a] for a in _data_operands(node) if a in ordered}
    if not kinds:
        return ""
    if name in _COMPARISONS and POSITION in kinds:
        return (
            f"{name} compares a row's position among the batch's rows with a bound (an "
            "expert's capacity, say: it keeps its first rows and drops the rest)"
        )
    if name in _SLICES and _shrinks(node):
        return (
            f"{name} keeps the first rows of a sort over the batch's rows (expert-choice "
            "routing by sorting, say)"
        )
    ordered[node] = POSITION if POSITION in kinds else SORTED
    return ""


def _source_kind(node: fx.Node, along: bool) -> str:
    """POSITION or SORTED where `node` gives the positions or the sorted values of the
    batch's rows, else ""."""
    name = op_name(node)
    if name == "arange":
        out = _info(node)
        return POSITION if out is not None and any(map(batched, out.shape)) else ""
    if name in ("nonzero", "argwhere"):
        rows = _info(node.args[0])
        return POSITION if rows is not None and any(map(batched, rows.shape)) else ""
    if name == "argsort":
        return POSITION if along else ""
    if name == "getitem":  # a sort's values (0) or indices (1)
        sort = node.args[0]
        if isinstance(sort, fx.Node) and op_name(sort) == "sort" and _along(sort):
            return POSITION if node.args[1] == 1 else SORTED
    return ""


def _shrinks(node: fx.Node) -> bool:
    """Whether a slice keeps fewer rows than its operand has along its dim."""
    operand, out = _info(node.args[0]), _info(node)
    dim = _argument(node, "dim", 0)
    if operand is None or out is None or not isinstance(dim, int) or not operand.shape:
        return False
    dim %= len(operand.shape)
    return batched(operand.shape[dim]) and operand.shape[dim] != out.shape[dim]


def _along(node: fx.Node) -> bool:
    """Whether `node` (a ranking, scan or sort) runs along a dim sized by the batch."""
    source = _info(node.args[0]) if node.args else None
    if source is None or not source.shape:
        return False
    dim = _argument(node, "dim", -1)
    if not isinstance(dim, int):
        return False
    return batched(source.shape[dim % len(source.shape)])


def _data_operands(node: fx.Node) -> list[fx.Node]:
    """The operands of `node` that it reads as values, not as indices into another."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return node.all_input_nodes
    names = [a.name for a in schema.arguments]
    values = [
        value
        for i, value in enumerate(node.args)
        if i >= len(names) or names[i] not in _INDEX_ARGUMENTS
    ] + [value for key, value in node.kwargs.items() if key not in _INDEX_ARGUMENTS]
    found: list[fx.Node] = []
    fx.node.map_arg(values, found.append)
    return found


def _normalizes(node: fx.Node) -> str:
    """Why `node` is a batch norm in training mode whose statistics run over the batch."""
    name = op_name(node)
    if name in _BATCH_NORMS and _training(node):
        shape = _info(node.args[0])
        # Statistics per channel (dim 1), over every other dim.
        if shape and any(map(batched, shape.shape[:1] + shape.shape[2:])):
            return f"{name} in training mode normalizes over the batch"
    return ""


def _mixes(node: fx.Node) -> str:
    """Why `node` gives a batch × batch result, where it arises."""
    name = op_name(node)
    out = _info(node)
    # Only where the batch × batch tensor arises, not every operator that carries it on.
    inputs = [_info(a) for a in node.all_input_nodes]
    if _batch_by_batch(out) and not any(map(_batch_by_batch, inputs)):
        return f"{name} gives a batch × batch result, every example against every other"
    return ""


def _info(x: object) -> TensorInfo | None:
    info = SHAPE.get(x, None) if isinstance(x, fx.Node) else None
    return info if isinstance(info, TensorInfo) else None


def _batch_by_batch(info: TensorInfo | None) -> bool:
    return info is not None and sum(map(batched, info.shape)) >= 2


def _training(node: fx.Node) -> bool:
    """The op's `training` argument; true for an op without one."""
    return bool(_argument(node, "training", True))


def _argument(node: fx.Node, name: str, default: object) -> object:
    """The op's argument `name` as the call gives it (by its schema), else `default`."""
    if name in node.kwargs:
        return node.kwargs[name]
    schema = getattr(node.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if name not in names:
        return default
    i = names.index(name)
    if i < len(node.args):
        return node.args[i]
    default_value = schema.arguments[i].default_value if schema is not None else None
    return default if default_value is None else default_value


def batched(size: sympy.Expr | int) -> bool:
    """Whether a size carries the batch (the batch, or a product with it)."""
    symbols = getattr(size, "free_symbols", ())
    return any(s.name == BATCH for s in symbols)
