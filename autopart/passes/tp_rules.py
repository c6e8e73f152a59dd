"""Sharding rules: how each operator's output is laid out over the tp axis, and over
the cp axis, whose walk (`passes/context_parallel.py`) shards the sequence with the
parameters whole (`Operands.context_parallel`: ring attention, symbolic sequence sizes,
and the tp rewrite's collectives, which pass a sequence shard through).

A rule sees one node with the placements of its tensor operands (`R` replicated,
`S(d)` sharded on dim d, `P` partial sums) and their global shapes, and decides:

- the placement each operand must have (the rewriter inserts the collective that
  converts it), including `copy_to_group` for a replicated operand whose gradient
  becomes partial because the op broadcasts it against a sharded one;
- the placement of the output;
- the size arguments to change so the local op sees local sizes (a `view` to 32
  heads becomes a view to 32/tp heads);
- or a fallback: an operator with no rule here takes DTensor's registered strategy
  (`tp_dtensor`); one without either replicates its inputs (all-gathers them),
  computes redundantly and warns once. Correct first, then fast.

Rules are pure: the same code plans (dry run) and rewrites.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence
from typing import SupportsInt, cast

import sympy
import torch
from torch import fx
from torch.distributed.tensor import Placement, Shard

from autopart.batch import SEQ
from autopart.ops.aten import ATTENTION_OPS, GROUPED_MM_OPS, VIEW_OPS, op_name
from autopart.ops.collectives import COLLECTIVES
from autopart.ops.collectives import reduce_scatter as tp_reduce_scatter
from autopart.ops.collectives import shard as tp_shard
from autopart.ops.context_parallel import attention_arguments, ring_refusal
from autopart.ops.meta import SHAPE, TensorInfo, tensor_info
from autopart.ops.vocab_parallel import vocab_parallel_embedding
from autopart.passes.tp_decision import (
    NO_RULE,
    Decision,
    LocalSize,
    NodePlacement,
    Operands,
    P,
    R,
    fallback,
    replicated_output,
)
from autopart.passes.tp_dtensor import dtensor_decision

# Needed on top of the `pointwise` tag: ops that act elementwise without carrying it.
_ELEMENTWISE = frozenset(
    {
        "to",
        "_to_copy",
        "clone",
        "contiguous",
        "alias",
        "detach",
        "dropout",
        "native_dropout",
        "type_as",
        "lift_fresh_copy",
        "masked_fill",
        "where",
        "relu",
        "gelu",
        "silu",
        "tanh",
    }
)
_REDUCTIONS = frozenset({"sum", "mean", "amax", "amin", "var", "std", "norm", "logsumexp"})
_NORMALIZE_LAST = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax"})
_CONTRACTIONS = frozenset({"linear", "mm", "addmm", "bmm", "baddbmm", "matmul"})
_IGNORED = frozenset({"_assert_tensor_metadata", "_assert_scalar", "sym_size", "sym_numel"})


def decide(ops: Operands, gm: fx.GraphModule) -> Decision:
    name = op_name(ops.node, gm)
    tensor_places = [ops.places[i] for i in ops.tensors]
    if ops.node.op == "call_function" and ops.node.target is operator.getitem:
        return Decision(output=_getitem(ops))
    if name in _IGNORED:
        return Decision(output=R)
    if ops.context_parallel and _sequence_parallel_slice(ops):
        # Sequence parallelism's slice (or reduce-scatter) of a value whole over cp
        # (positions read from a table at whole positions): cp's mirrored chunks first,
        # then tp's contiguous slice of them, the order the tokens were cut in.
        dim = ops.flat[1]
        return Decision(output=Shard(dim), inputs={0: Shard(dim)})
    if all(p == R for p in tensor_places):
        return Decision(output=replicated_output(ops.node))
    if any(p == P for p in tensor_places):
        return _reduce_partials_first(ops, gm)
    rule = _rule_for(name, ops.node)
    if rule is None:
        # DTensor's strategies shard contiguously; the cp walk's layout is mirrored.
        answer = None if ops.context_parallel else dtensor_decision(ops)
        return answer or fallback(ops, f"{NO_RULE} {name}")
    return rule(ops)


def _rule_for(name: str, node: fx.Node) -> Callable[[Operands], Decision] | None:
    if node.target in COLLECTIVES:
        return _within_tokens
    if node.target is vocab_parallel_embedding:
        return _embedding
    if name in _CONTRACTIONS:
        return _contraction
    if name in GROUPED_MM_OPS:
        return _grouped_contraction
    if name in ATTENTION_OPS:
        return _attention
    if name in ("view", "_unsafe_view", "reshape"):
        return _reshape
    if name == "flatten":
        return _flatten
    if name == "unflatten":
        return _unflatten
    if name in ("transpose", "t", "permute", "unsqueeze", "squeeze", "expand"):
        return _dim_shuffle
    if name in ("split", "split_with_sizes", "chunk"):
        return _split
    if name in ("slice", "select", "narrow"):
        return _slice
    if name == "cat":
        return _cat
    if name in _REDUCTIONS:
        return _reduction
    if name in _NORMALIZE_LAST:
        return _softmax
    if name == "layer_norm":
        return _layer_norm
    if name == "embedding":
        return _embedding
    if name in _ELEMENTWISE or _is_pointwise(node) or name in VIEW_OPS - {"getitem"}:
        return _elementwise
    return None


def _is_pointwise(node: fx.Node) -> bool:
    return torch.Tag.pointwise in getattr(node.target, "tags", ())


def _reduce_partials_first(ops: Operands, gm: fx.GraphModule) -> Decision:
    """Partial sums are reduced (all-reduce) before any op consumes them."""
    reduced = {i: R for i in ops.tensors if ops.places[i] == P}
    places = [R if p == P else p for p in ops.places]
    decision = decide(dataclasses.replace(ops, places=places), gm)
    decision.inputs = {**reduced, **decision.inputs}
    return decision


# ---------------------------------------------------------------------------------------
# Helpers on shapes and arguments


def _shape(ops: Operands, i: int) -> tuple[sympy.Expr, ...]:
    info = ops.shapes[i]
    assert info is not None, "a tensor operand with one placement has a TensorInfo"
    return info.shape


def _rank(ops: Operands, i: int) -> int:
    return len(_shape(ops, i))


def _norm_dim(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def _divisible(ops: Operands, size: sympy.Expr) -> bool:
    """Whether `size` is fixed and the degree divides it."""
    return isinstance(size, (int, sympy.Integer)) and ops.divides(int(size))


def _splits(ops: Operands, size: sympy.Expr) -> bool:
    """Whether a dim of `size` splits evenly over the axis: a fixed size it divides, or
    under context parallelism the sequence (which the runtime makes divide)."""
    if _divisible(ops, size):
        return True
    if not ops.context_parallel:
        return False
    coefficient, rest = sympy.sympify(size).as_coeff_Mul()
    return coefficient.is_Integer and rest.is_Symbol and rest.name == SEQ


def _local_size(ops: Operands, size: fx.node.Argument) -> int | LocalSize | None:
    """The local value of a size argument of a sharded dim: an integer divided, a
    symbolic size of the whole marked for the rewrite to divide, None for -1 (which
    infers it)."""
    if isinstance(size, fx.Node):
        return LocalSize(size)
    if isinstance(size, int) and size != -1:
        return ops.divided(size)
    return None


def _out_rank(node: fx.Node) -> int:
    info = SHAPE.get(node)
    return len(info.shape) if isinstance(info, TensorInfo) else 0


# fx types every argument as `Argument`, the union of all a graph can hold; the op's
# schema is what makes a dim or a size an int, and a list of them a sequence.


def _int(arg: fx.node.Argument) -> int:
    return int(cast(SupportsInt, arg))


def _seq(arg: fx.node.Argument) -> Sequence[fx.node.Argument]:
    return cast(Sequence[fx.node.Argument], arg)


def _dims(arg: fx.node.Argument) -> list[int]:
    """A dim argument that is one dim or a list of them."""
    return [arg] if isinstance(arg, int) else [_int(k) for k in _seq(arg)]


# ---------------------------------------------------------------------------------------
# Rules


def _elementwise(ops: Operands) -> Decision:
    """Broadcasting elementwise ops: operands align from the right; a sharded operand
    fixes the output dim; replicated operands that span that dim are sliced locally,
    those that broadcast over it keep their values but their gradient is partial."""
    out_rank = _out_rank(ops.node)
    sharded = {
        _norm_dim(p.dim, _rank(ops, i)) + out_rank - _rank(ops, i)
        for i in ops.tensors
        if isinstance(p := ops.places[i], Shard)
    }
    if len(sharded) != 1 or out_rank == 0:
        return fallback(ops, "operands sharded on different dims")
    out_dim = sharded.pop()
    decision = Decision(output=Shard(out_dim))
    for i in ops.tensors:
        if ops.places[i] != R:
            continue
        rank = _rank(ops, i)
        own_dim = out_dim - (out_rank - rank)
        if own_dim >= 0 and _shape(ops, i)[own_dim] != 1:
            decision.inputs[i] = Shard(own_dim)
        elif ops.grads[i]:
            decision.copy_to_group.add(i)
    return decision


def _within_tokens(ops: Operands) -> Decision:
    """A tensor-parallel collective, met by the context-parallel walk (which runs on the
    tensor-parallel rewrite's graph): it acts within each token, or under sequence
    parallelism along this rank's tokens, so the sequence shard passes through."""
    x = ops.places[0]
    if not isinstance(x, Shard):
        return fallback(ops, "expected a sharded input")
    return Decision(output=x)


def _sequence_parallel_slice(ops: Operands) -> bool:
    """Whether `ops.node` is the tp rewrite's slice (or reduce-scatter: a table sharded
    over its positions, looked up vocabulary-parallel) of a value whole over cp along the
    whole sequence: the dim it cuts is as long as the graph's sequence inputs' dim 1."""
    if ops.node.target not in (tp_shard, tp_reduce_scatter) or ops.places[0] != R:
        return False
    from autopart.passes.context_parallel import sequence_inputs  # it imports this module

    info, dim = ops.shapes[0], ops.flat[1]
    if info is None or not isinstance(dim, int):
        return False
    size = sympy.sympify(info.shape[dim])
    gm = ops.node.graph.owning_module
    if gm is None:
        return False
    lengths = {sympy.sympify(tensor_info(n).shape[1]) for n in sequence_inputs(gm)}
    return lengths == {size}


def _getitem(ops: Operands) -> Placement:
    index = ops.flat[1]
    place = ops.places[0]
    if isinstance(place, tuple):
        return place[index]
    return place if place is not None else R


def _dim_shuffle(ops: Operands) -> Decision:
    node, x = ops.node, ops.places[0]
    if not isinstance(x, Shard):
        return fallback(ops, "expected a sharded input")
    rank = _rank(ops, 0)
    d = _norm_dim(x.dim, rank)
    name = op_name(node)
    args = node.args
    if name == "t":
        return Decision(output=Shard(1 - d))
    if name == "transpose":
        a, b = (_norm_dim(_int(v), rank) for v in args[1:3])
        return Decision(output=Shard(b if d == a else a if d == b else d))
    if name == "permute":
        dims = [_norm_dim(_int(v), rank) for v in _seq(args[1])]
        return Decision(output=Shard(dims.index(d)))
    if name == "unsqueeze":
        k = _norm_dim(_int(args[1]), rank + 1)
        return Decision(output=Shard(d + (k <= d)))
    if name == "squeeze":
        shape = _shape(ops, 0)
        squeezed = args[1] if len(args) > 1 else [i for i, size in enumerate(shape) if size == 1]
        removed = [_norm_dim(k, rank) for k in _dims(squeezed) if shape[k] == 1]
        return Decision(output=Shard(d - sum(k < d for k in removed)))
    if name == "expand":
        return _expand(ops, d)
    return fallback(ops, f"no rule for {name}")


def _expand(ops: Operands, d: int) -> Decision:
    sizes_start = 1  # leaves: x, *sizes
    out_rank = _out_rank(ops.node)
    out_dim = d + out_rank - _rank(ops, 0)
    leaf = sizes_start + out_dim
    size = ops.flat[leaf]
    decision = Decision(output=Shard(out_dim))
    if isinstance(size, int) and size != -1 and not ops.divides(size):
        return fallback(ops, "expand size not divisible by tp")
    local = _local_size(ops, size)
    if local is not None:
        decision.updates[leaf] = local
    return decision


def _size_leaves(ops: Operands) -> list[int]:
    """Leaf indices of the size list of a view/reshape (everything after the tensor)."""
    return list(range(1, len(ops.flat)))


def _reshape(ops: Operands) -> Decision:
    """Map the sharded dim through the reshape. Input and output dims group into runs
    of equal product; the shard must sit on the outermost dim of its run on both sides
    (a split [h] -> [heads, hd] shards heads; a merge [heads, hd] -> [h] needs heads).
    Dims of size 1 hold nothing, so a run's leading ones do not count: a batch of one
    sequence merged with it ([1, seq, h] -> [seq, h], as GPT-2's Conv1D does) keeps
    the sequence's shard, and the reshape back gives it to the sequence again."""
    x = ops.places[0]
    if not isinstance(x, Shard):
        return fallback(ops, "expected a sharded input")
    in_shape = list(_shape(ops, 0))
    out_shape = list(tensor_info(ops.node).shape)
    d = _norm_dim(x.dim, len(in_shape))
    run = _run_of(in_shape, out_shape, d)
    if run is None:
        return fallback(ops, "reshape mixes the sharded dim with others")
    (in_first, _), (out_first, out_end) = run
    while in_first < d and in_shape[in_first] == 1:
        in_first += 1
    while out_first < out_end - 1 and out_shape[out_first] == 1:
        out_first += 1
    if in_first != d or not _splits(ops, out_shape[out_first]):
        return fallback(ops, "reshape splits the sharded dim unevenly")
    decision = Decision(output=Shard(out_first))
    leaf = _size_leaves(ops)[out_first]
    local = _local_size(ops, ops.flat[leaf])
    if local is not None:
        decision.updates[leaf] = local
    return decision


def _flatten(ops: Operands) -> Decision:
    """flatten(start, end) merges dims start..end: a shard outside them moves with the
    dims; a shard on `start`, the outermost of the merged dims, shards the merged dim."""
    x = ops.places[0]
    if not isinstance(x, Shard):
        return fallback(ops, "expected a sharded input")
    rank = _rank(ops, 0)
    d = _norm_dim(x.dim, rank)
    start, end = (
        _norm_dim(_int(_argument(ops.node, k, name, default)), max(rank, 1))
        for k, name, default in ((1, "start_dim", 0), (2, "end_dim", -1))
    )
    if d < start:
        return Decision(output=Shard(d))
    if d > end:
        return Decision(output=Shard(d - (end - start)))
    if d == start:
        return Decision(output=Shard(start))
    return fallback(ops, "flatten merges the sharded dim into an outer one")


def _unflatten(ops: Operands) -> Decision:
    """unflatten(dim, sizes) splits dim: a shard elsewhere moves with the dims; a shard
    on it goes to the outermost of the new dims, whose size becomes local."""
    x = ops.places[0]
    if not isinstance(x, Shard):
        return fallback(ops, "expected a sharded input")
    rank = _rank(ops, 0)
    d, dim = _norm_dim(x.dim, rank), _norm_dim(_int(ops.flat[1]), rank)
    new_dims = len(ops.flat) - 2  # leaves: x, dim, *sizes
    if d != dim:
        return Decision(output=Shard(d if d < dim else d + new_dims - 1))
    if not _splits(ops, tensor_info(ops.node).shape[dim]):
        return fallback(ops, "unflatten splits the sharded dim unevenly")
    decision = Decision(output=Shard(dim))
    local = _local_size(ops, ops.flat[2])
    if local is not None:
        decision.updates[2] = local
    return decision


def _argument(node: fx.Node, position: int, name: str, default: int) -> fx.node.Argument:
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, default)


def _run_of(
    in_shape: list[sympy.Expr], out_shape: list[sympy.Expr], d: int
) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """The (in_start, in_end), (out_start, out_end) runs of equal product containing
    input dim d, skipping size-1 dims at the run edges."""
    i = j = 0
    while i < len(in_shape) or j < len(out_shape):
        i0, j0 = i, j
        pin = in_shape[i] if i < len(in_shape) else 1
        pout = out_shape[j] if j < len(out_shape) else 1
        i, j = i + 1, j + 1
        while not _equal(pin, pout):
            if _lt(pin, pout) and i < len(in_shape):
                pin, i = pin * in_shape[i], i + 1
            elif j < len(out_shape):
                pout, j = pout * out_shape[j], j + 1
            else:
                return None
        if i0 <= d < i:
            return (i0, i), (j0, j)
    return None


def _equal(a: sympy.Expr, b: sympy.Expr) -> bool:
    """Sizes are products of numbers and dims: expanding decides equality, far cheaper
    than simplifying."""
    return a == b or sympy.expand(a - b) == 0


def _lt(a: sympy.Expr, b: sympy.Expr) -> bool:
    """a < b for sizes. With named dims (batch, seq: at least 2 each, as captured) the
    comparison is decided where b is a multiple of a: batch < batch·seq."""
    try:
        return bool(sympy.Lt(a, b))
    except TypeError:
        numerator, denominator = sympy.fraction(sympy.cancel(sympy.sympify(b) / a))
        return denominator == 1 and numerator != 1


def _split(ops: Operands) -> Decision:
    node, x = ops.node, ops.places[0]
    if not isinstance(x, Shard):
        return fallback(ops, "expected a sharded input")
    rank = _rank(ops, 0)
    d = _norm_dim(x.dim, rank)
    name = op_name(node)
    dim = _norm_dim(_int(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)), rank)
    info = SHAPE.get(node)
    assert isinstance(info, tuple), "a split has one output per part"
    parts = len(info)
    outputs = tuple(Shard(d) for _ in range(parts))
    if dim != d:
        return Decision(output=outputs)
    # Splitting the sharded dim itself: valid when the weight that produced it was
    # sharded part by part (a fused q/k/v projection); the rewriter arranges that.
    if name == "split" and isinstance(node.args[1], int) and ops.divides(node.args[1]):
        total = _shape(ops, 0)[d]
        if total == node.args[1] * parts:
            local = ops.divided(node.args[1])
            return Decision(output=outputs, updates={1: local}, fused_split=parts)
    if name == "chunk" and _splits(ops, sympy.sympify(_shape(ops, 0)[d]) / parts):
        return Decision(output=outputs, fused_split=parts)
    return fallback(ops, "uneven split of the sharded dim")


def _slice(ops: Operands) -> Decision:
    node, x = ops.node, ops.places[0]
    if not isinstance(x, Shard):
        return fallback(ops, "expected a sharded input")
    rank = _rank(ops, 0)
    d = _norm_dim(x.dim, rank)
    dim = _norm_dim(_int(node.args[1]) if len(node.args) > 1 else 0, rank)
    if dim == d and _whole_slice(node):
        return Decision(output=Shard(d))
    if dim == d:
        return fallback(ops, "slicing the sharded dim")
    if op_name(node) == "select":
        return Decision(output=Shard(d - (dim < d)))
    return Decision(output=Shard(d))


def _whole_slice(node: fx.Node) -> bool:
    """`x[:, 0:]` and its kin: a slice from the start to the end (or past it), step 1,
    which Hugging Face models take of their hidden states (`logits_to_keep=0`)."""
    if op_name(node) != "slice":
        return False
    start, end, step = (list(node.args[2:5]) + [None, None, 1][len(node.args[2:5]) :])[:3]
    to_the_end = end is None or (isinstance(end, int) and end >= 2**62)
    return bool(start in (None, 0) and step == 1 and to_the_end)


def _cat(ops: Operands) -> Decision:
    dim = _int(ops.node.args[1]) if len(ops.node.args) > 1 else 0
    decision = _elementwise(ops)
    if decision.fallback:
        return fallback(ops, "concatenating along the sharded dim")
    assert isinstance(decision.output, Shard), "without a fallback, the output is sharded"
    if decision.output.dim == _norm_dim(dim, _out_rank(ops.node)):
        return fallback(ops, "concatenating along the sharded dim")
    decision.copy_to_group.clear()  # cat never broadcasts
    return decision


def _reduction(ops: Operands) -> Decision:
    node, x = ops.node, ops.places[0]
    if not isinstance(x, Shard):
        return fallback(ops, "expected a sharded input")
    rank = _rank(ops, 0)
    d = _norm_dim(x.dim, rank)
    reduced = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if reduced is None:
        return fallback(ops, "reduction over every dim")
    dims = [_norm_dim(k, rank) for k in _dims(reduced)]
    if d in dims:
        return fallback(ops, "reduction over the sharded dim")
    keepdim = bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
    return Decision(output=Shard(d if keepdim else d - sum(k < d for k in dims)))


def _softmax(ops: Operands) -> Decision:
    x = ops.places[0]
    if not isinstance(x, Shard):
        return fallback(ops, "expected a sharded input")
    rank = _rank(ops, 0)
    if _norm_dim(x.dim, rank) == _norm_dim(_int(ops.node.args[1]), rank):
        return fallback(ops, "softmax over the sharded dim")
    return Decision(output=x)


def _layer_norm(ops: Operands) -> Decision:
    x = ops.places[0]
    rank = _rank(ops, 0)
    normalized = len(_seq(ops.node.args[1]))
    if not isinstance(x, Shard) or _norm_dim(x.dim, rank) >= rank - normalized:
        return fallback(ops, "layer norm over the sharded dim")
    decision = Decision(output=x)
    for i in ops.tensors[1:]:
        if ops.places[i] != R:
            decision.inputs[i] = R
        if ops.grads[i]:
            decision.copy_to_group.add(i)  # weight and bias see only this rank's rows
    return decision


def _embedding(ops: Operands) -> Decision:
    """Ids sharded (along the sequence): a sharded lookup. A table sharded over the
    vocabulary (dim 0) with whole ids: each rank looks up its rows, giving partial sums
    (`vocab_parallel_embedding`); needs the default padding and dense gradients."""
    weight, ids = ops.places[0], ops.places[1]
    given = list(ops.flat[2:5])
    padding_idx, scale, sparse = given + [-1, False, False][len(given) :]
    # `is False`, not `== False`: a padding row at index 0 equals False in Python.
    defaults = padding_idx == -1 and scale is False and sparse is False
    if _normalized(weight, 2) == Shard(0) and ids == R and defaults:
        return Decision(output=P, local_op="vocab_parallel_embedding")
    if weight != R:
        return fallback(ops, "sharded embedding table")
    if isinstance(ids, Shard):
        decision = Decision(output=Shard(_norm_dim(ids.dim, _rank(ops, 1))))
        if ops.grads[0]:
            decision.copy_to_group.add(0)
        return decision
    return fallback(ops, "embedding")


def _attention(ops: Operands) -> Decision:
    """Heads (dim 1 of [batch, heads, seq, head_dim]) shard cleanly: q, k and v must be
    sharded on them, or replicated (then sliced); a mask broadcast over heads stays
    whole."""
    qkv = [_normalized(ops.places[i], _rank(ops, i)) for i in ops.tensors[:3]]
    if ops.context_parallel and Shard(2) in qkv:
        return _ring_attention(ops, qkv)
    whole = [i for i, p in zip(ops.tensors[:3], qkv) if p == R]
    if Shard(1) not in qkv or any(p not in (R, Shard(1)) for p in qkv):
        return fallback(ops, "attention not sharded on heads")
    if not all(_divisible(ops, _shape(ops, i)[1]) for i in whole):
        return fallback(ops, "attention heads not divisible by tp")
    # Replicated keys or values (multi-query attention's one head, expanded to every
    # query head) are sliced to this rank's heads.
    decision = Decision(output=Shard(1), inputs={i: Shard(1) for i in whole})
    for i in ops.tensors[3:]:
        shape = _shape(ops, i)
        if ops.places[i] == R and len(shape) == 4 and shape[1] != 1:
            decision.inputs[i] = Shard(1)
    return decision


def _ring_attention(ops: Operands, qkv: list[NodePlacement | None]) -> Decision:
    """Under context parallelism, attention of q, k and v sharded over the sequence (dim
    2) runs as ring attention (`ops.context_parallel.ring_attention`), causal or not,
    whichever way its arguments are written (`is_causal` by keyword, or positionally
    after a None mask and 0.0 dropout as torch.export writes it): without a mask or
    dropout, which it does not take (`ring_refusal`), and, causal, over as many keys as
    queries (its causal pairs of chunks are by position)."""
    node = ops.node
    reason = "ring attention takes q, k and v sharded on the sequence"
    if op_name(node) != "scaled_dot_product_attention":
        return fallback(ops, f"{reason}, through scaled_dot_product_attention")
    if any(p != Shard(2) for p in qkv) or ops.tensors != [0, 1, 2] or len(node.args) < 3:
        return fallback(ops, f"{reason} and no other tensor")
    named = attention_arguments(node.args[3:], node.kwargs)
    refusal = ring_refusal(named)
    if refusal or named is None:
        return fallback(ops, f"{reason}, not attention with {refusal}")
    if named["is_causal"] and _shape(ops, 0)[2] != _shape(ops, 1)[2]:
        return fallback(ops, f"{reason}, causal over as many keys as queries")
    return Decision(output=Shard(2), local_op="ring_attention")


def _normalized(p: NodePlacement | None, rank: int) -> NodePlacement | None:
    return Shard(_norm_dim(p.dim, rank)) if isinstance(p, Shard) else p


def _contraction(ops: Operands) -> Decision:
    """Matrix products. With operands a [..., m, k] and b [..., k, n] (for linear, b is
    the weight transposed): sharding n (column parallel) or m gives a sharded output;
    sharding k on both gives partial sums, reduced right after; batch dims shard like
    elementwise ops. A bias follows the output, or the reduction for partial sums."""
    node = ops.node
    name = op_name(node)
    t = ops.tensors
    bias_i: int | None
    if name in ("addmm", "baddbmm"):
        bias_i, a_i, b_i = t[0], t[1], t[2]
    else:
        a_i, b_i = t[0], t[1]
        bias_i = t[2] if len(t) > 2 else None
    a, b = ops.places[a_i], ops.places[b_i]
    ra, rb = _rank(ops, a_i), _rank(ops, b_i)
    transposed = name == "linear"  # weight is [n, k]
    a_m, a_k = ra - 2, ra - 1
    b_k, b_n = (rb - 1, rb - 2) if transposed else (rb - 2, rb - 1)
    da = _norm_dim(a.dim, ra) if isinstance(a, Shard) else None
    db = _norm_dim(b.dim, rb) if isinstance(b, Shard) else None
    out_rank = _out_rank(node)
    decision = Decision(output=R)
    if db == b_n and (a == R or (da is not None and da < a_k and rb == 2)):
        decision.output = Shard(out_rank - 1)  # column parallel
        if a != R:  # sequence parallel: gather the sequence, reduce-scatter its gradient
            decision.inputs[a_i] = R
            decision.gather_grad.add(a_i)
        elif ops.grads[a_i]:
            decision.copy_to_group.add(a_i)
        if bias_i is not None and ops.places[bias_i] == R:
            decision.inputs[bias_i] = Shard(len(_shape(ops, bias_i)) - 1)
        return decision
    if da == a_k and (db == b_k or (b == R and rb == 2)):
        if b == R:
            decision.inputs[b_i] = Shard(b_k)
        if bias_i is not None and ops.places[bias_i] != R:
            decision.inputs[bias_i] = R  # added whole, once, after the reduction
        decision.reduce_to = R  # row parallel: partial sums over k
        decision.has_bias = bias_i is not None
        decision.output = R
        return decision
    if da is not None and da < a_k and (b == R or (db is not None and db < rb - 2)):
        if da == a_m and b != R:
            return fallback(ops, "both operands sharded on free dims")
        decision.output = Shard(da + out_rank - ra)  # m or a batch dim
        if b == R and ops.grads[b_i] and rb >= 2:
            decision.copy_to_group.add(b_i)
        if bias_i is not None and ops.grads[bias_i]:
            decision.copy_to_group.add(bias_i)
        return decision
    return fallback(ops, f"{name} with operands {a} and {b}")


def _grouped_contraction(ops: Operands) -> Decision:
    """Routed rows a [rows, k] times experts' stacked weights b [E, k, n], each run of
    rows (ending at the offsets, which stay whole) by its own expert's matrix: an
    expert tensor-parallel layer. Sharding n (b's last dim) gives every row n/tp of its
    outputs (column parallel, the layer's first product); sharding k of both operands
    gives partial sums, reduced right after (row parallel, its last). The rows are
    never split: every rank routes the same rows, so the offsets hold for each."""
    a_i, b_i, *rest = ops.tensors
    ra, rb = _rank(ops, a_i), _rank(ops, b_i)
    if (ra, rb) != (2, 3) or not rest:  # grouped by offsets into the rows, not by a dim
        return fallback(ops, f"grouped multiply of {ra}-d by {rb}-d operands")
    if any(ops.places[i] != R for i in rest):
        return fallback(ops, "grouped multiply with sharded offsets")
    a, b = ops.places[a_i], ops.places[b_i]
    da = _norm_dim(a.dim, ra) if isinstance(a, Shard) else None
    db = _norm_dim(b.dim, rb) if isinstance(b, Shard) else None
    decision = Decision(output=R)
    if a == R and db == rb - 1:
        decision.output = Shard(ra - 1)
        if ops.grads[a_i]:
            decision.copy_to_group.add(a_i)
        return decision
    if da == ra - 1 and (db == rb - 2 or b == R):
        if b == R:
            decision.inputs[b_i] = Shard(rb - 2)
        decision.reduce_to = R
        return decision
    return fallback(ops, f"grouped multiply with operands {a} and {b}")
