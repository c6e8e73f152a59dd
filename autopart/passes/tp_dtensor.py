"""DTensor's registered sharding strategies as a strategy generator, for the operators
autopart's rules (`tp_rules`) do not cover.

PyTorch registers a sharding strategy for hundreds of aten operators (cumsum, sort,
topk, gather, flip, norms, pooling, ...). For an operator without an autopart rule, the
walk asks DTensor's sharding propagator what it would do with the operands' placements
on a 1-D mesh of tp ranks: the output's placement, and the operands it would
redistribute first. That answer becomes a `Decision` like a rule's, so the layout model
prices it, the walk records it and the rewrite applies it. Where DTensor replicates the
operator anyway, or answers with what the rewrite cannot run (another kind of partial
sum, an uneven shard, sizes to localize), the operator falls back as before.

autopart's rules come first where both exist: they know what DTensor's strategies leave
to its runtime (the local sizes of views, fused q/k/v splits, the vocabulary-parallel
embedding and cross-entropy, sequence-parallel reductions).

The propagator is asked on a mesh without process groups: strategies depend on the
mesh's shape only, and planning (one process) must get the answer every rank's rewrite
gets.

Every answer is checked before it is taken: the operator runs once whole and once per
rank on its shards, on small random operands, and the shards must give the whole's
result (its slices, or its partial sums). An answer that does not, or that cannot be
checked, is not taken. (DTensor's cumsum strategy, for one, keeps a shard of the very
dim it scans when the dim is given as -1.)
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable

import sympy
import torch
from torch import fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils import _pytree as pytree

from autopart.ops.meta import SHAPE, TensorInfo
from autopart.passes.tp_decision import Decision, NodePlacement, Operands, P, R, flatten_args

log = logging.getLogger("autopart.tp")


def _has_decomposition_strategy(op: torch._ops.OpOverload) -> bool:
    """Whether DTensor shards `op` by the strategies of the operators it decomposes to
    (torch 2.13's DecompShardingStrategy; before it, DTensor had no such strategies)."""
    try:
        from torch.distributed.tensor._sharding_prop import DecompShardingStrategy
    except ImportError:
        return False
    return DecompShardingStrategy.has_decomp(op)


# A dynamic dim's size when asking DTensor (its strategies read sizes only to keep
# shards non-empty): per tp rank, so that tp divides it.
NOMINAL_SIZE_PER_RANK = 1024


def dtensor_decision(ops: Operands) -> Decision | None:
    """DTensor's strategy for `ops.node` with its operands placed as `ops.places`, or
    None where it has none the rewrite can run, or none that shards anything. Answers
    are kept by operator, placements, shapes and arguments: the solver walks the graph
    once per layout it tries, and a block's copies ask the same question."""
    if not _askable(ops.node.target):
        return None
    key = _question(ops)
    if key not in _ANSWERS:
        if len(_ANSWERS) >= MAX_ANSWERS:
            _ANSWERS.clear()
        _ANSWERS[key] = _answer(ops)
    answer = _ANSWERS[key]
    if answer is None:
        return None
    output, inputs = answer
    decision = Decision(output=output, inputs=dict(inputs))
    for i in ops.tensors:
        if not ops.grads[i]:
            continue
        if inputs.get(i) == R:  # gathered for a split computation: its grad is partial
            decision.gather_grad.add(i)
        elif i not in inputs and ops.places[i] == R:
            decision.copy_to_group.add(i)  # read whole by every rank's share
    return decision


Answer = tuple[NodePlacement, dict[int, Placement]] | None
_ANSWERS: dict[tuple, Answer] = {}
MAX_ANSWERS = 4096


def _question(ops: Operands) -> tuple:
    """What an answer depends on: the operator, tp, the output's shape, and each leaf's
    placement and shape (a tensor) or value."""
    leaves = tuple(
        (str(ops.places[i]), str(ops.shapes[i])) if i in ops.tensors else repr(leaf)
        for i, leaf in enumerate(ops.flat)
    )
    spec = str(flatten_args(ops.node)[1])
    return (ops.node.target, ops.tp, str(SHAPE.get(ops.node)), spec, leaves)


def _answer(ops: Operands) -> Answer:
    """(output placement, operands to convert) from DTensor, checked on shards."""
    op = ops.node.target
    assert isinstance(op, torch._ops.OpOverload)
    leaves: list[object] = []
    for i, leaf in enumerate(ops.flat):
        place, info = ops.places[i], ops.shapes[i]
        if place is None and isinstance(leaf, fx.Node):
            return None  # a symbolic scalar, which DTensor cannot size
        if place is None:
            leaves.append(leaf)
        elif isinstance(place, Shard | Replicate) and info is not None:
            leaves.append(_spec(place, info, ops.tp))
        else:
            return None
    args, kwargs = pytree.tree_unflatten(leaves, flatten_args(ops.node)[1])
    try:
        propagator = _propagator()
        # The schema info tells DTensor which arguments to look into (a list of tensors).
        schema = OpSchema(op, args, kwargs, schema_info=propagator.op_to_schema_info.get(op))
        answer = propagator.propagate_op_sharding_non_cached(schema)
    except Exception as e:  # noqa: BLE001 - any refusal of DTensor's is "no strategy"
        log.debug("DTensor has no strategy for %s: %s", op, e)
        return None
    output = _output(ops.node, answer.output_spec, ops.tp)
    inputs = _redistributed(ops, answer.redistribute_schema) if answer.needs_redistribute else {}
    if output is None or inputs is None or not _distributed(output):
        return None
    if not _checked(ops, inputs, output):
        log.debug("DTensor's strategy for %s gives other results on shards: not taken", op)
        return None
    return output, inputs


def _askable(op: object) -> bool:
    """An aten operator DTensor has a strategy for, whose arguments stay valid for the
    local shards (no sizes to localize), that mutates nothing and draws no random
    numbers (a rank's share would draw other numbers than one device)."""
    if not isinstance(op, torch._ops.OpOverload):
        return False
    propagator = _propagator()
    registered = (
        op in propagator.op_strategy_funcs
        or op in propagator.op_single_dim_strategy_funcs
        or op in propagator.op_to_rules
        or _has_decomposition_strategy(op)  # strategies of the ops it decomposes to
    )
    sizes = (
        op in propagator.op_to_shape_and_stride_idx or op in propagator.op_to_scalar_shape_adjuster
    )
    random = torch.Tag.nondeterministic_seeded in op.tags
    return registered and not sizes and not random and not op._schema.is_mutable


@functools.cache
def _propagator() -> ShardingPropagator:
    return DTensor._op_dispatcher.sharding_propagator


@functools.cache
def _mesh(tp: int) -> DeviceMesh:
    return DeviceMesh("cpu", list(range(tp)), _init_backend=False, _rank=0)


def _spec(place: Placement, info: TensorInfo, tp: int) -> DTensorSpec:
    shape = tuple(_size(s, tp) for s in info.shape)
    stride = tuple(math.prod(shape[k + 1 :]) for k in range(len(shape)))
    return DTensorSpec(_mesh(tp), (place,), TensorMeta(torch.Size(shape), stride, info.dtype))


def _size(size: sympy.Expr | int, tp: int) -> int:
    expr = sympy.sympify(size)
    return int(expr.subs({s: NOMINAL_SIZE_PER_RANK * tp for s in expr.free_symbols}))


def _output(node: fx.Node, spec: object, tp: int) -> NodePlacement | None:
    """The node's placement from DTensor's output spec(s): one, or one per output."""
    info = SHAPE.get(node)
    specs = list(spec) if isinstance(spec, tuple | list) else [spec]
    infos = list(info) if isinstance(info, tuple) else [info]
    if len(specs) != len(infos):
        return None
    places = []
    for s, i in zip(specs, infos):
        place = _placement(s.placements[0]) if isinstance(s, DTensorSpec) else R
        if place is None or not _even(place, i, tp):
            return None
        places.append(place)
    return tuple(places) if isinstance(info, tuple) else places[0]


def _redistributed(ops: Operands, schema: OpSchema | None) -> dict[int, Placement] | None:
    """The operands DTensor converts first, by leaf index, and to what."""
    if schema is None:
        return {}
    leaves = pytree.tree_leaves((schema.args_schema, schema.kwargs_schema))
    if len(leaves) != len(ops.flat):
        return None
    inputs: dict[int, Placement] = {}
    for i in ops.tensors:
        spec = leaves[i]
        if not isinstance(spec, DTensorSpec):
            return None
        want = _placement(spec.placements[0])
        if want is None or want == P or not _even(want, ops.shapes[i], ops.tp):
            return None
        if want != ops.places[i]:
            inputs[i] = want
    return inputs


def _placement(place: Placement) -> Placement | None:
    """DTensor's placement as the rewrite knows it: partial sums only by addition."""
    if isinstance(place, Partial):
        return P if place.reduce_op == "sum" else None
    return place if type(place) in (Shard, Replicate) else None


def _even(place: Placement, info: object, tp: int) -> bool:
    """Whether a shard splits its dim evenly (a dynamic dim is taken to: the operand it
    comes from was split so)."""
    if not isinstance(place, Shard):
        return True
    if not isinstance(info, TensorInfo) or place.dim >= len(info.shape):
        return False
    size = sympy.sympify(info.shape[place.dim])
    return bool(size.free_symbols) or int(size) % tp == 0


def _distributed(output: NodePlacement) -> bool:
    places = output if isinstance(output, tuple) else (output,)
    return any(p != R for p in places)


# -- checking an answer -------------------------------------------------------------------

# The operands' sizes when checking: a dim of up to this many per rank keeps its size;
# a larger one shrinks to it (one more where tp does not divide it, so that it still
# does not divide).
CHECK_SIZE_PER_RANK = 4
CPU = torch.device("cpu")  # whatever device the model is planned on


def _checked(ops: Operands, inputs: dict[int, Placement], output: NodePlacement) -> bool:
    """Whether the operator, run on each rank's operands (as placed after `inputs`'s
    conversions), gives each rank its part of the whole result under `output`."""
    op, tp = ops.node.target, ops.tp
    assert isinstance(op, torch._ops.OpOverload)
    spec = flatten_args(ops.node)[1]
    generator = torch.Generator().manual_seed(0)
    whole = list(ops.flat)
    for i in ops.tensors:
        info = ops.shapes[i]
        assert info is not None
        whole[i] = _random(info, tp, generator)
    try:
        with torch.no_grad():
            want = _run(op, whole, spec)
            got = []
            for rank in range(tp):
                local = list(whole)
                for i in ops.tensors:
                    place = inputs.get(i, ops.places[i])
                    if isinstance(place, Shard):
                        local[i] = whole[i].tensor_split(tp, place.dim)[rank]
                got.append(_run(op, local, spec))
            places = output if isinstance(output, tuple) else (output,)
            return len(places) == len(want) and all(
                _part_matches(w, [g[k] for g in got], place, tp)
                for k, (w, place) in enumerate(zip(want, places))
            )
    except Exception as e:  # noqa: BLE001 - an operator the random operands do not suit
        log.debug("cannot check DTensor's strategy for %s: %s", op, e)
        return False


def _run(op: Callable[..., object], flat: list[object], spec: pytree.TreeSpec) -> list[object]:
    """The operator's outputs, as a list, on the arguments `flat` (leaves of `spec`)."""
    args, kwargs = pytree.tree_unflatten(flat, spec)
    result = op(*args, **kwargs)
    return list(result) if isinstance(result, tuple | list) else [result]


def _random(info: TensorInfo, tp: int, generator: torch.Generator) -> torch.Tensor:
    shape = [_check_size(s, tp) for s in info.shape]
    if info.dtype.is_floating_point:
        return torch.randn(shape, generator=generator, dtype=torch.float64, device=CPU).to(
            info.dtype
        )
    if info.dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator, device=CPU).bool()
    return torch.randint(0, 2, shape, generator=generator, device=CPU).to(info.dtype)


def _check_size(size: sympy.Expr | int, tp: int) -> int:
    expr = sympy.sympify(size)
    limit = CHECK_SIZE_PER_RANK * tp
    if expr.free_symbols:
        return limit
    n = int(expr)
    if n <= limit:
        return n
    return limit if n % tp == 0 else limit + 1


def _part_matches(whole: object, parts: list[object], place: Placement, tp: int) -> bool:
    if not isinstance(whole, torch.Tensor):
        return all(p == whole for p in parts)
    if not all(isinstance(p, torch.Tensor) for p in parts):
        return False
    tensors = [p for p in parts if isinstance(p, torch.Tensor)]
    if place == P:
        candidates = [torch.stack(tensors).sum(0)]
        expected = [whole]
    elif isinstance(place, Shard):
        candidates, expected = tensors, list(whole.tensor_split(tp, place.dim))
    else:
        candidates, expected = tensors, [whole] * tp
    return all(_close(c, e) for c, e in zip(candidates, expected))


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if not want.dtype.is_floating_point:
        return torch.equal(got, want)
    return torch.allclose(got.double(), want.double(), rtol=1e-3, atol=1e-5)
