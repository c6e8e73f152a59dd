"""Where analysis results live: one namespaced `node.meta` key per analysis, and one
`gm.meta` key per decision a rewrite pass records on the graph it returns.

Each result is read through its key, whose getter fails loudly when the pass that
writes it has not run (in the manner of `torch.fx.passes.shape_prop`'s `tensor_meta`),
unless the caller gives a default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeAlias, TypeVar

import sympy
import torch
from torch import fx
from torch.distributed.tensor import Placement

if TYPE_CHECKING:
    from autopart.ops.loss_match import CrossEntropy

T = TypeVar("T")
_REQUIRED: Any = object()


class AnalysisMissing(LookupError):
    pass


class MetaKey(Generic[T]):
    """A namespaced key of `node.meta` (or, for a `GraphKey`, of `gm.meta`)."""

    def __init__(self, name: str, written_by: str) -> None:
        self.key = f"autopart.{name}"
        self.written_by = written_by

    def set(self, holder: fx.Node | fx.GraphModule, value: T) -> None:
        holder.meta[self.key] = value

    def has(self, holder: fx.Node | fx.GraphModule) -> bool:
        return self.key in holder.meta

    def get(self, holder: fx.Node | fx.GraphModule, default: T = _REQUIRED) -> T:
        """The value; `default` where there is none, or AnalysisMissing without one."""
        try:
            return holder.meta[self.key]
        except KeyError:
            if default is not _REQUIRED:
                return default
            name = holder.name if isinstance(holder, fx.Node) else type(holder).__name__
            raise AnalysisMissing(
                f"{name!r} has no {self.key}: run {self.written_by} first"
            ) from None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.key})"


class GraphKey(MetaKey[T]):
    """A key of `gm.meta`: what a rewrite pass decided for the whole graph it returns."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Shape (sympy expressions of the named dynamic dims, or integers) and dtype."""

    shape: tuple[sympy.Expr, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> sympy.Expr:
        return sympy.Mul(*self.shape) if self.shape else sympy.Integer(1)

    @property
    def nbytes(self) -> sympy.Expr:
        return self.numel * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True, slots=True)
class Traffic:
    """Bytes an operator reads from and writes to memory."""

    read: sympy.Expr
    written: sympy.Expr


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """A node's place among structurally identical repeated blocks (transformer layers).

    `block_id` names the structure class; `instance` the module path of this copy."""

    block_id: str
    instance: str
    index: int


@dataclass(frozen=True, slots=True)
class CollectiveInfo:
    """A collective a rewrite pass inserted: what it does, over which mesh axis and
    process group, and the bytes each rank contributes in forward."""

    kind: str
    axis: str
    group: str
    bytes: sympy.Expr | int

    def __str__(self) -> str:
        return f"{self.kind} over {self.axis} (group {self.group}): {self.bytes} bytes"


# What SHAPE holds for a node: one tensor, a tuple of them (None for a non-tensor item)
# for a multi-output op, or None for a node that produces no tensor.
NodeShape: TypeAlias = TensorInfo | tuple[TensorInfo | None, ...] | None

# One key per analysis.
SHAPE: MetaKey[NodeShape] = MetaKey("shape", "shape_pass")
MODULE_PATH: MetaKey[str] = MetaKey("module_path", "module_path_pass")
FLOPS: MetaKey[sympy.Expr] = MetaKey("flops", "flops_pass")
TRAFFIC: MetaKey[Traffic] = MetaKey("traffic", "traffic_pass")
PARAMS: MetaKey[tuple[str, ...]] = MetaKey("params", "params_pass")
SAVED_BYTES: MetaKey[sympy.Expr] = MetaKey("saved_bytes", "saved_for_backward_pass")
# Which attention core of a repeated block a node belongs to (an index per graph), and,
# on a core's first node (0 on the others), the bytes that recomputing the core alone
# frees (selective recomputation).
ATTENTION_CORE: MetaKey[int] = MetaKey("attention_core", "attention_core_pass")
CORE_FREES_BYTES: MetaKey[sympy.Expr] = MetaKey("core_frees_bytes", "saved_for_backward_pass")
BLOCK: MetaKey[BlockInfo | None] = MetaKey("block", "blocks_pass")
COLLECTIVE: MetaKey[CollectiveInfo] = MetaKey("collective", "a rewrite pass")
# How a node's local value relates to its single-device value after the tensor-parallel
# rewrite: its tp placement (Shard, Replicate, Partial), or None where it is no piece of
# it (a row-parallel product whose bias moved after the reduction). For autopart.verify.
TP_PLACE: MetaKey[Placement | None] = MetaKey("tp_place", "tensor_parallel_pass")
# A value the context-parallel rewrite left sharded over cp: Shard(d), this rank's two
# chunks of dim d (SHAPE holds the whole's). Pipeline stages size what they exchange by it.
CP_PLACE: MetaKey[Placement] = MetaKey("cp_place", "context_parallel_pass")

# Tensor-parallel parameters of a rewritten graph: FQN -> (sharded dim, parts of a fused
# weight), for slicing checkpoints and reassembling whole parameters.
TP_LAYOUT: GraphKey[dict[str, tuple[int, int]]] = GraphKey("tp_layout", "tensor_parallel_pass")
# The loss a graph's output feeds where the tensor-parallel rewrite left that output's
# logits sharded over the vocabulary (no gather): the runtime computes it in parallel.
VOCAB_PARALLEL_LOSS: GraphKey[CrossEntropy] = GraphKey(
    "vocab_parallel_loss", "tensor_parallel_pass"
)
# Parameters whose gradient each context-parallel rank holds a part of (its tokens'),
# left for the data-parallel sync to sum over cp (`policy.cp_gradients_in_sync`).
CP_SUMMED: GraphKey[frozenset[str]] = GraphKey("cp_summed", "context_parallel_pass")
# The stacked expert weights expert parallelism split over ep (dim 0, the experts).
EP_SHARDED: GraphKey[frozenset[str]] = GraphKey("ep_sharded", "expert_parallel_pass")
# The size of each named dim ("batch", "seq") in the example the graph was captured with:
# what a cost is evaluated at where a caller does not give a dim's size.
EXAMPLE_DIMS: GraphKey[dict[str, int]] = GraphKey("example_dims", "capture")


def inherit(node: fx.Node, source: fx.Node, shape: Any = _REQUIRED) -> None:
    """Give a node a rewrite pass inserted the context later passes read: `source`'s
    module path and block, no parameters of its own, and `shape` where given."""
    MODULE_PATH.set(node, MODULE_PATH.get(source, ""))
    BLOCK.set(node, BLOCK.get(source, None))
    PARAMS.set(node, ())
    if shape is not _REQUIRED:
        SHAPE.set(node, shape)


def tensor_info(node: fx.Node) -> TensorInfo:
    """The one tensor a node produces."""
    info = SHAPE.get(node)
    if not isinstance(info, TensorInfo):
        raise TypeError(f"{node.name} does not produce a single tensor")
    return info


def tensor_infos(node: fx.Node) -> tuple[TensorInfo, ...]:
    """Every tensor a node produces, flattened."""
    info = SHAPE.get(node)
    if info is None:
        return ()
    if isinstance(info, TensorInfo):
        return (info,)
    return tuple(i for i in info if i is not None)
