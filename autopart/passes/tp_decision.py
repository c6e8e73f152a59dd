"""What a sharding decision is: the placements a tp layout gives one operator.

`Operands` is what a strategy generator sees of one node (its flattened arguments, the
placements and global shapes of its tensor operands); `Decision` is what it answers.
Two generators answer: autopart's rules (`tp_rules`) and, for operators without one,
DTensor's registered strategies (`tp_dtensor`). The walk (`tp_propagate`) records their
decisions and the rewrite applies them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeAlias

from torch import fx
from torch.distributed.tensor import Partial, Placement, Replicate
from torch.utils import _pytree as pytree

from autopart.ops.meta import SHAPE, TensorInfo

R = Replicate()
P = Partial()
NO_RULE = "no sharding rule for"  # how a fallback for an operator without a rule begins

# A node's placement: one, or one per output of a multi-output op (split, chunk).
NodePlacement: TypeAlias = Placement | tuple[Placement, ...]


@dataclass
class Decision:
    """What a rule decided for one node. Indices refer to the node's flattened
    (args, kwargs) leaves."""

    output: NodePlacement
    inputs: dict[int, Placement] = field(default_factory=dict)
    copy_to_group: set[int] = field(default_factory=set)  # R operands with partial grads
    updates: dict[int, Any] = field(default_factory=dict)  # size leaves' values, or LocalSize
    # A row-parallel product: its partial sums are reduced right after it, to `reduce_to`
    # (R by all-reduce; S(1) by reduce-scatter under sequence parallelism), and a bias
    # is added once, after the reduction.
    reduce_to: Placement | None = None
    has_bias: bool = False
    gather_grad: set[int] = field(default_factory=set)  # S -> R with reduce-scatter backward
    fused_split: int = 0  # a split of a sharded dim into this many equal parts
    fallback: str = ""  # why the op is replicated instead
    # The local operator that runs instead (`ops.local_ops.LOCAL_OPS`), called with the
    # node's arguments and the group of the axis.
    local_op: str = ""

    def copy(self) -> Decision:
        """A copy whose containers are its own (later passes edit them in place);
        `dataclasses.replace` does the same several times slower, and a walk copies one
        per node of every later block copy."""
        return Decision(
            output=self.output,
            inputs=dict(self.inputs),
            copy_to_group=set(self.copy_to_group),
            updates=dict(self.updates),
            reduce_to=self.reduce_to,
            has_bias=self.has_bias,
            gather_grad=set(self.gather_grad),
            fused_split=self.fused_split,
            fallback=self.fallback,
            local_op=self.local_op,
        )


@dataclass(frozen=True, slots=True)
class LocalSize:
    """An update of a size argument that is a symbolic size of the whole tensor (a
    `sym_size` node): the rewrite divides it by the degree, as a rule divides an
    integer size."""

    size: fx.Node


@dataclass
class Operands:
    """A node's flattened (args, kwargs) with what is known of each tensor leaf."""

    node: fx.Node
    flat: list[Any]
    places: list[NodePlacement | None]  # None where the leaf is not a tensor node
    shapes: list[TensorInfo | None]
    grads: list[bool]  # whether the leaf requires grad
    # The degree of the axis the walk shards over. A rule reads it through `tp`,
    # `divides` or `divided`, which the walk records (`DegreeReads`).
    degree: int
    # A walk over the cp axis: the inputs' sequences are sharded (in the mirrored
    # layout of `ops.context_parallel`), the runtime guarantees the sequence divides
    # into 2·cp chunks, and attention over sequence shards runs as ring attention.
    context_parallel: bool = False
    reads: DegreeReads | None = field(default=None, repr=False, compare=False)

    # The indices of the tensor leaves: the rules ask for them many times per node.
    tensors: list[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.tensors = [i for i, p in enumerate(self.places) if p is not None]

    @property
    def tp(self) -> int:
        """The degree, read as a number: a walk whose rules read it so holds at this
        degree alone (`DegreeReads`)."""
        if self.reads is not None:
            self.reads.as_number = True
        return self.degree

    def divides(self, size: int) -> bool:
        """Whether the degree divides `size`: a question the walk records."""
        answer = size % self.degree == 0
        if self.reads is not None:
            self.reads.answers[size] = answer
        return answer

    def divided(self, size: int) -> int:
        """`size` over the degree, for a decision's `updates` alone (the sizes the
        rewrite writes, which a walk's layout at another degree does not read)."""
        return size // self.degree


class DegreeReads:
    """What a walk's rules read of the degree: whether it divides each size they asked
    of (`Operands.divides`), and whether any read it as a number (`Operands.tp`). Where
    none did, the walk makes the same decisions at every degree that answers its
    questions alike, but for the sizes its `updates` divide (`Operands.divided`): the
    cost models price several context-parallel degrees from one walk (`holds_at`)."""

    def __init__(self) -> None:
        self.answers: dict[int, bool] = {}
        self.as_number = False

    def holds_at(self, degree: int) -> bool:
        """Whether the walk's decisions hold at `degree`, `updates` aside."""
        return not self.as_number and all(
            (size % degree == 0) == divides for size, divides in self.answers.items()
        )


def replicated_output(node: fx.Node) -> NodePlacement:
    info = SHAPE.get(node)
    return tuple(R for _ in info) if isinstance(info, tuple) else R


def fallback(ops: Operands, reason: str) -> Decision:
    """Replicate every tensor operand and compute the op redundantly."""
    return Decision(
        output=replicated_output(ops.node),
        inputs={i: R for i in ops.tensors if ops.places[i] != R},
        fallback=reason,
    )


def flatten_args(node: fx.Node) -> tuple[list[Any], Any]:
    """The leaves of a node's arguments and their structure (pytree's), to rebuild them."""
    return pytree.tree_flatten((node.args, node.kwargs))


def argument_leaves(node: fx.Node) -> list[Any]:
    """`flatten_args(node)[0]`, an order of magnitude faster: the solver walks every
    node of the graph once per layout it tries. An fx node's arguments nest only tuples,
    lists and dicts (fx's immutable ones among them), which pytree flattens in order,
    dict values in insertion order."""
    out: list[Any] = []

    def walk(a: Any) -> None:
        if type(a) in _SEQUENCES:
            for x in a:
                walk(x)
        elif type(a) in _MAPPINGS:
            for x in a.values():
                walk(x)
        else:
            out.append(a)

    walk(node.args)
    walk(node.kwargs)
    return out


_SEQUENCES = (tuple, list, fx.immutable_collections.immutable_list)
_MAPPINGS = (dict, fx.immutable_collections.immutable_dict)
