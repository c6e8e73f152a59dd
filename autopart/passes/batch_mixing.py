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

Three of these are exact under a split of the batch over replicas once a rewrite takes
them over the whole batch (`exact_over_replicas`; the planner asks for those apart,
`mixing_over_replicas`, since microbatches within a replica still split them):

- batch normalization as torch.export captures it (`aten.batch_norm`), whose statistics
  the batch-norm rewrite reduces over the replicas (`reduced_over_replicas`,
  passes/batch_norm.py);
- a batch × batch product each of whose operands carries the batch in one dim, and whose
  result meets no other value of the batch on its way to the output
  (`gathered_products`): the batch-products rewrite gathers its operands over the
  replicas (passes/batch_products.py);
- statistics combined over the batch, where each is a mean over it, or a sum the model
  divides (by its token count, say) before combining it (`replica_statistics`): the
  batch-statistics rewrite takes each replica's as the mean of every replica's
  (passes/batch_statistics.py).

Found only where the capture keeps the batch dynamic (the default; not a model captured
on the meta device, whose batch is static). A reduction over the batch that only feeds
the loss linearly (a mean of per-example losses, scaled) is not flagged: the runtime
averages the parts' losses, which is that mean.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

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
    gm: fx.GraphModule, statistics: bool = True, over_replicas: bool = True
) -> list[str]:
    """How and where `gm` mixes the examples of its batch, one line per kind ("batch_norm
    in training mode normalizes over the batch, at blocks.0.1, blocks.1.1"); empty
    where the examples are computed apart. Without `statistics`, batch norms,
    statistics combined over the batch and routing over its rows are not counted (the
    user accepts them per part); without `over_replicas`, the mixing a rewrite makes
    exact over replicas (`exact_over_replicas`) is not. Needs the shape and
    module-path analyses."""
    exact = set() if over_replicas else set(exact_over_replicas(gm, statistics))
    return _worded(_found(gm, statistics), exact)


def mixing_over_replicas(gm: fx.GraphModule, statistics: bool = True) -> list[str]:
    """The mixing a rewrite makes exact over replicas, as `batch_mixing` words it: exact
    under a split over replicas, not over microbatches (a replica's first microbatch
    would be computed before its last is seen)."""
    return mixing_kinds(gm, statistics)[1]


def mixing_kinds(gm: fx.GraphModule, statistics: bool = True) -> tuple[list[str], list[str]]:
    """`batch_mixing(gm, statistics, over_replicas=False)` and `mixing_over_replicas(gm,
    statistics)`, from one pass of the analyses over the graph."""
    found = _found(gm, statistics)
    exact = set(exact_over_replicas(gm, statistics))
    return _worded(found, exact), _worded({n: w for n, w in found.items() if n in exact}, set())


def exact_over_replicas(gm: fx.GraphModule, statistics: bool = True) -> list[fx.Node]:
    """The nodes whose mixing a rewrite takes over the whole batch where it is split over
    replicas: batch norms and combined statistics (unless the user takes `statistics`
    per part), and batch × batch products."""
    products = gathered_products(gm)
    if not statistics:
        return products
    norms = [n for n in gm.graph.nodes if reduced_over_replicas(n)]
    found = replica_statistics(gm)
    return norms + products + (list(found.combined) if found else [])


def _found(gm: fx.GraphModule, statistics: bool) -> dict[fx.Node, str]:
    """Each node that mixes the batch, and why."""
    found: dict[fx.Node, str] = {}
    seen: set[fx.Node] = set()  # values reduced over the batch, and what they feed
    ordered: dict[fx.Node, str] = {}  # positions among the batch's rows, sorted rows
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        why = (_normalizes(node) if statistics else "") or _mixes(node)
        if not why and statistics:
            why = _combines_statistics(node, seen) or _routes_rows(node, ordered)
        if why:
            found[node] = why
    return found


def _worded(found: dict[fx.Node, str], left_out: set[fx.Node]) -> list[str]:
    """One line per kind, naming its module paths in order, without `left_out`."""
    kinds: dict[str, dict[str, None]] = {}  # kind -> module paths, ordered, no repeats
    for node, why in found.items():
        if node not in left_out:
            kinds.setdefault(why, {})[_path(node)] = None
    return [f"{why}, at {', '.join(paths)}" for why, paths in kinds.items()]


def reduced_over_replicas(node: fx.Node) -> bool:
    """Whether `node` is a batch norm in training mode over the batch, as torch.export
    captures it (`aten.batch_norm`), which the batch-norm rewrite replaces by one over
    the whole batch (ops/batch_norm.py). Its lowerings, which return their saved
    statistics, and a traced module are left as they are, and so split nothing."""
    return node.target is torch.ops.aten.batch_norm.default and bool(_normalizes(node))


def gathered_products(gm: fx.GraphModule) -> list[fx.Node]:
    """The batch × batch products the batch-products rewrite gathers over the replicas:
    every one where each, `product_operands`, carries the batch in one dim, and what is
    computed from them reads no other value sized by the batch (which would be this
    replica's part only); else none."""
    products = [n for n in gm.graph.nodes if n.op == "call_function" and _mixes(n)]
    if not products or not all(product_operands(n) for n in products):
        return []
    carried = computed_from(products)
    for node in carried.difference(products):
        for a in node.all_input_nodes:
            if a not in carried and (_sized_by_batch(a) or _symbolic(a)):
                return []
    return products


def product_operands(node: fx.Node) -> list[tuple[fx.Node, int]]:
    """Each operand of `node` that carries the batch, with the dim it carries it in;
    empty where one carries it in more than one dim."""
    found = []
    for a in node.all_input_nodes:
        info = _info(a)
        dims = [d for d, size in enumerate(info.shape) if batched(size)] if info else []
        if len(dims) > 1:
            return []
        found += [(a, dims[0])] if dims else []
    return found


def computed_from(nodes: list[fx.Node]) -> set[fx.Node]:
    """`nodes` and every node computed from them (the graph's output aside)."""
    found = set(nodes)
    for node in nodes[0].graph.nodes:
        if node.op == "call_function" and any(a in found for a in node.all_input_nodes):
            found.add(node)
    return found


def _sized_by_batch(node: fx.Node) -> bool:
    info = _info(node)
    return info is not None and any(map(batched, info.shape))


def _symbolic(node: fx.Node) -> bool:
    """A size computed from a tensor's shape (this replica's, where it is the batch)."""
    return isinstance(node.meta.get("val"), torch.SymInt | torch.SymFloat)


@dataclass(frozen=True, slots=True)
class ReplicaStatistics:
    """Statistics over the batch the model combines nonlinearly, where the
    batch-statistics rewrite makes them the whole batch's: `roots`, the reductions over
    the batch; `combined`, where they are combined."""

    roots: tuple[fx.Node, ...]
    combined: tuple[fx.Node, ...]


# Statistics that are sums over the batch's rows: a replica's part over the mean of the
# parts' is the whole batch's over its count, where the model divides by its part's.
_SUMS = frozenset({"sum", "histc", "bincount", "count_nonzero"})


def replica_statistics(gm: fx.GraphModule) -> ReplicaStatistics | None:
    """The statistics `gm` combines over its batch, where each is a mean over the batch,
    or a sum divided by a value the model computes (its part's token count, or another
    statistic) before it is combined; None where one is not, or none is combined."""
    roots: dict[fx.Node, frozenset[fx.Node]] = {}  # carried value -> its statistics
    divided: set[fx.Node] = set()
    combined: list[fx.Node] = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or _sized_by_batch(node) or _info(node) is None:
            continue
        if op_name(node) in _STATISTICS and any(map(_sized_by_batch, node.all_input_nodes)):
            roots[node] = frozenset({node})
            continue
        carried = [a for a in node.all_input_nodes if a in roots]
        if not carried:
            continue
        roots[node] = frozenset().union(*(roots[a] for a in carried))
        name = op_name(node)
        numerator = node.args[0] if node.args else None
        if name == "div" and numerator in roots and isinstance(node.args[1], fx.Node):
            divided |= roots[numerator]
        if (name in ("mul", "div") and len(carried) >= 2) or name in _NONLINEAR:
            combined.append(node)
    used = frozenset().union(*(roots[n] for n in combined))
    exact = all(op_name(r) == "mean" or (op_name(r) in _SUMS and r in divided) for r in used)
    if not combined or not exact:
        return None
    return ReplicaStatistics(tuple(r for r in roots if r in used), tuple(combined))


def updates_running_statistics(node: fx.Node) -> bool:
    """Whether `node` is a batch norm in training mode that updates running statistics
    in place: run twice (recomputed in backward), it would update them twice."""
    return reduced_over_replicas(node) and isinstance(node.args[3], fx.Node)


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


@functools.lru_cache(maxsize=4096)  # the analyses ask of the same few sizes all along
def batched(size: sympy.Expr | int) -> bool:
    """Whether a size carries the batch (the batch, or a product with it)."""
    symbols = getattr(size, "free_symbols", ())
    return any(s.name == BATCH for s in symbols)
