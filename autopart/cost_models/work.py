"""The work of one operator as numbers, for given sizes of the named dims.

The analysis passes leave sympy expressions of the named dims (`batch`, `seq`) in
`node.meta`: FLOPs, bytes read and written, bytes saved for backward. A cost model needs
numbers, so `node_work` substitutes the sizes once per operator and keeps what the
compute and memory models read: the FLOPs, the bytes moved (activations read, written,
and parameters read, which scale differently with the batch, the precision and tensor
parallelism), the bytes saved for backward, for contractions the matmul shape (m, n, k)
that decides how close to peak the kernel runs, the evaluations of a transcendental
function (`FUNCTIONS`), and whether the operator goes through the dispatcher at all
(views do; reading a tuple item or a size is Python alone).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import sympy
import torch
from torch import fx

from autopart.cost_models.fusion import fused_work
from autopart.ops.aten import ATTENTION_OPS, GROUPED_MM_OPS, MATMUL_OPS, op_name
from autopart.ops.meta import (
    ATTENTION_CORE,
    CORE_FREES_BYTES,
    FLOPS,
    PARAMS,
    SAVED_BYTES,
    SHAPE,
    TRAFFIC,
    TensorInfo,
)
from autopart.passes.causal_attention import runs_causal
from autopart.passes.traffic import READS_OPERAND

LOW_PRECISION_DTYPES = frozenset({torch.float16, torch.bfloat16})

MATMUL = "matmul"
ATTENTION = "attention"
OTHER = "other"
CONVOLUTIONS = frozenset({"convolution", "conv_transpose"})
# Call nodes that run in Python without dispatching a tensor operator: a tuple's item, a
# size, a shape assertion on symbolic sizes.
HOST_ONLY = frozenset(
    {
        "getitem",
        "size",
        "sym_size",
        "dim",
        "numel",
        "_assert_scalar",
        "sym_constrain_range_for_size",
    }
)
_CALLS = ("call_function", "call_method", "call_module")
# Pointwise functions whose arithmetic can cost more than their memory traffic: on a CPU
# a vectorized tanh takes tens of cycles an element (0.4 G elements/s on one x86 core,
# against 10 G for a negation). Operator -> the function it evaluates once per output
# element; the softmaxes evaluate exp, and cross-entropy once per logit (its
# log-softmax: its input's elements, `_function_evaluations`). Attention evaluates exp
# once per score.
FUNCTIONS = {
    "exp": "exp",
    "tanh": "tanh",
    "sigmoid": "sigmoid",
    "silu": "silu",
    "gelu": "gelu",
    "erf": "erf",
    "log": "log",
    "sin": "sin",
    "cos": "cos",
    "_softmax": "exp",
    "softmax": "exp",
    "_log_softmax": "exp",
    "log_softmax": "exp",
    "cross_entropy_loss": "exp",
}
# Operators that evaluate their function once per element of their first operand, not
# of their output: a loss reduces the logits it exponentiates to one value.
PER_INPUT_ELEMENT = frozenset({"cross_entropy_loss"})
# Operators whose backward evaluates their function again; the others' gradients are
# arithmetic on the saved output (tanh' = 1 − y², softmax's Jacobian product, ...).
# Flash attention recomputes the probabilities from the scores in backward.
FUNCTION_IN_BACKWARD = frozenset({"silu", "gelu", "erf", "sin", "cos"})
# Operators other than contractions whose backward moves more or less than their
# forward did (operator -> backward over forward): cross-entropy's gradient fills a
# zero tensor of the logits' size and scatters the targets' entries into it, then the
# log-softmax's backward sums each row of it, and reads it again with the saved
# log-probabilities to write the logits' gradient: five passes over the logits'
# size, against forward's four (`passes/traffic.py`).
BACKWARD_PASSES = {"cross_entropy_loss": 5 / 4}


class MissingDim(KeyError):
    """A cost depends on a named dim whose size was not given."""


@dataclass(frozen=True, slots=True)
class NodeWork:
    """One operator's forward work. Bytes are as captured (the graph's dtypes)."""

    kind: str  # MATMUL, ATTENTION or OTHER
    flops: float
    read_bytes: float = 0.0  # tensors read other than parameters
    written_bytes: float = 0.0
    param_bytes: float = 0.0  # parameters read
    saved_bytes: float = 0.0  # saved for backward
    in_attention_core: bool = False  # what selective recomputation recomputes
    core_frees_bytes: float = 0.0  # on a core's first operator: what recomputing it frees
    shape: tuple[float, float, float] | None = None  # (m, n, k) of a contraction
    # A matrix product's operand layout (`matmul_layout`): "nt" where it reads its second
    # operand transposed (a linear layer, x @ W^T), "nn" where both are as stored; None
    # for other contractions.
    layout: str | None = None
    tp_sharded: bool = False  # split over the tensor-parallel axis (Megatron layout)
    # Split, but what it saves for backward is a replicated operand (the input of a
    # column-parallel product), whole on every tp rank.
    tp_saves_replicated: bool = False
    dispatched: bool = True  # runs an operator through the dispatcher (views included)
    function: str | None = None  # the transcendental it evaluates (FUNCTIONS)
    evaluations: float = 0.0  # how many times, in forward
    evaluates_in_backward: bool = False  # and as many again in backward
    backward_passes: float = 1.0  # its backward over its forward, if not a contraction
    # Captured in 16 bits (a model built in fp16 or bf16): autocast has nothing to cast
    # and its bytes are already what a mixed-precision step moves (`precision.py`).
    low_precision: bool = False
    # Under context parallelism, run on the whole sequence on every cp rank (gathered
    # for it, `cp_layout.py`), not on the rank's share of the tokens.
    cp_whole: bool = False
    # Attention that runs causal (`passes.causal_attention.runs_causal`): a fused
    # kernel skips the key blocks past each query block's diagonal.
    causal: bool = False
    # In a compiled program (`fusion.py`): whether inductor fuses it with its neighbours
    # (not a contraction or a fallback), and then the activation bytes it reads from and
    # writes to memory (a view's none); it ends a kernel where it writes.
    fusible: bool = False
    fused_read_bytes: float = 0.0
    fused_written_bytes: float = 0.0
    # What it keeps for backward in a compiled program (`fusion.py`; a contraction's
    # is its `saved_bytes`).
    fused_saved_bytes: float = 0.0

    @property
    def bytes(self) -> float:
        return self.read_bytes + self.written_bytes + self.param_bytes

    @property
    def is_contraction(self) -> bool:
        return self.kind != OTHER

    @property
    def fused_bytes(self) -> float:
        """Bytes it moves fused in a compiled program: its parameters, and the
        activations it reads from and writes to memory (`fusion.fused_work`)."""
        return self.fused_read_bytes + self.fused_written_bytes + self.param_bytes

    def sharded(self, tp: int) -> NodeWork:
        """This rank's share under `tp`-way tensor parallelism: a sharded operator does
        1/tp of the FLOPs, moves 1/tp of the bytes and saves 1/tp of its activations
        (all of them where it saves a replicated operand).
        A sharded linear layer splits its wider weight dim (column-parallel splits n,
        row-parallel splits k, and in both the split dim is the wide one: 4h or the
        FFN width); attention splits heads, which leaves each head's shape alone."""
        if tp == 1 or not self.tp_sharded:
            return self
        shape = self.shape
        if shape is not None and self.kind == MATMUL:
            m, n, k = shape
            shape = (m, n / tp, k) if n >= k else (m, n, k / tp)
        return replace(
            self,
            flops=self.flops / tp,
            read_bytes=self.read_bytes / tp,
            written_bytes=self.written_bytes / tp,
            param_bytes=self.param_bytes / tp,
            fused_read_bytes=self.fused_read_bytes / tp,
            fused_written_bytes=self.fused_written_bytes / tp,
            saved_bytes=self.saved_bytes / (1 if self.tp_saves_replicated else tp),
            fused_saved_bytes=self.fused_saved_bytes / (1 if self.tp_saves_replicated else tp),
            core_frees_bytes=self.core_frees_bytes / tp,
            shape=shape,
            evaluations=self.evaluations / tp,
        )

    def scaled(self, factor: float) -> NodeWork:
        """The work on `factor` times the batch: everything but the parameters scales,
        and so does the row count m of a contraction."""
        if factor == 1:
            return self
        shape = self.shape
        if shape is not None and self.kind == MATMUL:
            shape = (shape[0] * factor, shape[1], shape[2])
        return replace(
            self,
            flops=self.flops * factor,
            read_bytes=self.read_bytes * factor,
            written_bytes=self.written_bytes * factor,
            fused_read_bytes=self.fused_read_bytes * factor,
            fused_written_bytes=self.fused_written_bytes * factor,
            saved_bytes=self.saved_bytes * factor,
            fused_saved_bytes=self.fused_saved_bytes * factor,
            core_frees_bytes=self.core_frees_bytes * factor,
            shape=shape,
            evaluations=self.evaluations * factor,
        )


def evaluate(expr: sympy.Expr | int | float, dims: Mapping[str, float]) -> float:
    """The value of an expression of named dims at the sizes `dims` ({name: size}). A
    size may be a fraction: a context-parallel rank's share of a microbatch below one
    sequence (half of one on each of 2 ranks) is priced as that fraction of it."""
    if isinstance(expr, (int, float)):
        return float(expr)
    if expr.is_Number:
        return float(expr)
    try:
        values = {s: _size(dims[s.name]) for s in expr.free_symbols}
    except KeyError as missing:
        raise MissingDim(
            f"the cost depends on the dim {missing.args[0]!r}: give its size, for example "
            f"dims={{{missing.args[0]!r}: ...}}"
        ) from None
    return float(expr.xreplace(values))


def _size(value: float) -> sympy.Number:
    """A dim's size as sympy takes it exactly: an integer, or the fraction it is."""
    return sympy.Integer(int(value)) if float(value).is_integer() else sympy.Rational(value)


def node_work(
    node: fx.Node,
    gm: fx.GraphModule,
    dims: Mapping[str, float],
    param_bytes: Mapping[str, int],
    tp_sharded: bool = False,
) -> NodeWork:
    """The forward work of `node` at the sizes `dims`. `param_bytes` maps a parameter's
    FQN to its size in bytes (the graph's parameters)."""
    name = op_name(node, gm)
    kind = op_kind(name)
    flops = evaluate(FLOPS.get(node), dims)
    traffic = TRAFFIC.get(node)
    read = evaluate(traffic.read, dims)
    params = min(float(sum(param_bytes.get(fqn, 0) for fqn in PARAMS.get(node))), read)
    shape = _contraction_shape(node, name, kind, flops, dims)
    function, evaluations = _function_evaluations(node, name, kind, shape, dims)
    fused = fused_work(gm).get(node)
    fused_read = evaluate(fused.read, dims) if fused else 0.0
    saved = evaluate(SAVED_BYTES.get(node), dims)
    return NodeWork(
        kind=kind,
        flops=flops,
        read_bytes=read - params,
        written_bytes=evaluate(traffic.written, dims),
        param_bytes=params,
        saved_bytes=saved,
        in_attention_core=ATTENTION_CORE.has(node),
        core_frees_bytes=evaluate(CORE_FREES_BYTES.get(node, 0), dims),
        shape=shape,
        layout=matmul_layout(node, name),
        tp_sharded=tp_sharded,
        dispatched=node.op in _CALLS and name not in HOST_ONLY,
        function=function,
        evaluations=evaluations,
        evaluates_in_backward=kind == ATTENTION or name in FUNCTION_IN_BACKWARD,
        backward_passes=BACKWARD_PASSES.get(name, 1.0),
        low_precision=is_low_precision(SHAPE.get(node)),
        causal=kind == ATTENTION and runs_causal(gm, node),
        fusible=fused is not None,
        # its parameters are counted apart, as eager
        fused_read_bytes=max(0.0, fused_read - params),
        fused_written_bytes=evaluate(fused.written, dims) if fused else 0.0,
        fused_saved_bytes=evaluate(fused.saved, dims) if fused else saved,
    )


def cross_entropy_work(logits: TensorInfo, dims: Mapping[str, float]) -> NodeWork:
    """A standard cross-entropy over `logits` that the runtime computes after the
    captured graph (the `loss_fn` the plan recognized, `ops/loss_match.py`), priced as
    the graph's own `cross_entropy_loss` would be: it reads the logits and the class
    indices (the logits three times, `passes/traffic.py`), writes the log-softmax and
    exponentiates every logit. What it keeps for backward is counted with the output's
    gradients (`MemoryModel`), so it saves nothing here."""
    numel = evaluate(logits.numel, dims)
    nbytes = evaluate(logits.nbytes, dims)
    rows = numel / evaluate(logits.shape[-1], dims) if logits.shape else 1.0
    name = "cross_entropy_loss"
    return NodeWork(
        kind=OTHER,
        flops=numel,
        read_bytes=READS_OPERAND[name][1] * nbytes + rows * torch.int64.itemsize,
        written_bytes=nbytes + torch.float32.itemsize,
        function=FUNCTIONS[name],
        evaluations=numel,
        backward_passes=BACKWARD_PASSES[name],
        low_precision=is_low_precision(logits),
    )


def is_low_precision(info: object) -> bool:
    """Whether a value's captured dtype is a 16-bit float (what autocast computes in)."""
    return isinstance(info, TensorInfo) and info.dtype in LOW_PRECISION_DTYPES


# Matrix products whose second operand is (batch, ) k × n; addmm and baddbmm take it
# third, after the term they add.
_PRODUCTS = {"mm": 1, "bmm": 1, "matmul": 1, "addmm": 2, "baddbmm": 2}
_TRANSPOSES = frozenset({"t", "transpose", "permute"})


def matmul_layout(node: fx.Node, name: str) -> str | None:
    """ "nt" for a product that reads its second operand transposed: a linear layer (its
    weight is stored out × in), or a product whose second operand is a transpose of its
    last two dims (`t`, as torch.export writes a linear; a key's transpose in eager
    attention); "nn" for any other matrix product; None for convolutions, grouped
    products, einsum and attention, priced by one curve."""
    if name == "linear":
        return "nt"
    position = _PRODUCTS.get(name)
    if position is None:
        return None
    operands = [*node.args, *node.kwargs.values()]
    second = operands[position] if len(operands) > position else None
    return "nt" if isinstance(second, fx.Node) and _swaps_last_two(second) else "nn"


def _swaps_last_two(node: fx.Node) -> bool:
    """Whether `node` is a view of its input with the last two dims swapped."""
    name = op_name(node)
    if name == "t":
        return True
    out = SHAPE.get(node)
    if name not in _TRANSPOSES or not isinstance(out, TensorInfo) or len(out.shape) < 2:
        return False
    rank = len(out.shape)
    args = node.args[1:]
    dims = list(args[0]) if len(args) == 1 and isinstance(args[0], (list, tuple)) else args
    wrapped = [d % rank for d in dims if isinstance(d, int)]
    if len(wrapped) != len(dims):
        return False
    if name == "transpose":
        return sorted(wrapped) == [rank - 2, rank - 1]
    return wrapped == [*range(rank - 2), rank - 1, rank - 2]


def op_kind(name: str) -> str:
    """MATMUL, ATTENTION or OTHER for an operator name (`passes.ops.op_name`)."""
    if name in ATTENTION_OPS:
        return ATTENTION
    if name in MATMUL_OPS or name in CONVOLUTIONS or name in GROUPED_MM_OPS:
        return MATMUL
    return OTHER


def _contraction_shape(
    node: fx.Node, name: str, kind: str, flops: float, dims: Mapping[str, float]
) -> tuple[float, float, float] | None:
    """(m, n, k) from the output shape and the FLOPs (2·m·n·k for a matmul).

    A matmul's n is the output's last dim (a convolution's: its channels, dim 1) and m
    the rest of the output; k = FLOPs / (2·m·n). Attention is the batched matmul of
    scores: m = query length L, k = head dim E, n = key length S, recovered from the
    FLOPs 2·B·H·L·S·(E + Ev) with Ev = E."""
    out = SHAPE.get(node)
    if kind == OTHER or not isinstance(out, TensorInfo) or not out.shape or not flops:
        return None
    numel = evaluate(out.numel, dims)
    if kind == ATTENTION:
        length, head = evaluate(out.shape[-2], dims), evaluate(out.shape[-1], dims)
        return (length, flops / (4 * numel), head)
    n = evaluate(out.shape[1] if name in CONVOLUTIONS else out.shape[-1], dims)
    m = numel / n
    return (m, n, flops / (2 * numel))


def _function_evaluations(
    node: fx.Node,
    name: str,
    kind: str,
    shape: tuple[float, float, float] | None,
    dims: Mapping[str, float],
) -> tuple[str | None, float]:
    """(function, evaluations in forward): exp once per attention score (B·H·L·S, the
    output's B·H·L·E elements times S/E), or `FUNCTIONS[name]` once per output element
    (per element of the first operand for `PER_INPUT_ELEMENT`)."""
    out = SHAPE.get(node)
    if not isinstance(out, TensorInfo):
        return None, 0.0
    if kind == ATTENTION and shape is not None:
        _, keys, head = shape
        return "exp", evaluate(out.numel, dims) * keys / head
    if name in FUNCTIONS:
        counted = _first_operand(node) if name in PER_INPUT_ELEMENT else out
        return FUNCTIONS[name], evaluate(counted.numel, dims) if counted else 0.0
    return None, 0.0


def _first_operand(node: fx.Node) -> TensorInfo | None:
    first = node.args[0] if node.args else None
    info = SHAPE.get(first) if isinstance(first, fx.Node) else None
    return info if isinstance(info, TensorInfo) else None
