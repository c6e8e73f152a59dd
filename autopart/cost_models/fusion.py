"""What compiling a rank's programs changes in the prediction (`Plan.compiled`).

`parallelize(..., compile=True)` hands each stage's graph to inductor
(`runtime/compiled.py`). What that changes, and all that the cost models change for it:

- Fused operators. Inductor generates one kernel for each run of the operators between
  the contractions (elementwise operators, normalizations and other reductions,
  indexing, dropout), which it does not call as library kernels. A fused kernel reads
  from memory only what flows into the run (the contractions' outputs, the inputs,
  the parameters) and writes only what leaves it (what a contraction or the graph's
  output reads); what one operator of the run hands to the next stays in registers.
  So an operator of a run moves only the bytes of its operands made outside runs and,
  where something outside reads its result, that result (`fused_work`); views move
  and cost nothing (eager, they are priced at the operator floor).
- Floors. A fused kernel pays one floor, not one per operator; a contraction, still a
  library call (`extern_kernels.mm`, attention's aten kernel), pays one. Inductor's
  CPU wrapper calls each kernel from Python and allocates its buffers there:
  `COMPILED_FLOOR` eager operator floors (`DeviceSpec.kernel_launch_s`, an average
  over a layer's operators, views among them). Each call of a compiled region
  (dynamo's guards, AOTAutograd's wrapper, its autograd node in backward) costs
  `REGION_FLOORS` floors in forward and as many in backward, and `TENSOR_FLOORS` more
  for each parameter tensor the stage takes. The three are fitted on this project's
  2-core x86 host (torch 2.13, inductor's C++ backend): on
  `benchmarks/cost_model_fidelity.py`'s four compiled plans (tiny GPT-2 and Llama, one
  process and dp=2), each epoch's compiled step over the same epoch's eager one, 16
  pairs, median error 3.5%. Alone, a one-operator region added 7-12 floors a
  direction and 0.2-0.7 more per parameter it takes (the floor measured as `autopart
  calibrate` does, in the same process). The host was shared and loaded: coarse.
- Backward. AOTAutograd compiles the backward too: a fused run's backward is priced as
  its forward's fused traffic again (eager: every operator's own, `compute.py`), and its
  arithmetic with its transcendental functions evaluated again: the partitioner
  recomputes in backward what the forward did not keep (below).
- Regions. A stage compiles whole, but ZeRO-3's gathers stay out of the graph
  (`ops/zero3.py`): each bucket's gather starts and ends a region.
- Memory. AOTAutograd's partitioner recomputes a fused run's cheap results in backward
  rather than saving them: an operator that saves something eager keeps, compiled,
  only those of its operands (and its result) that are in memory anyway, and none a
  contraction keeps already (`_FusedGraph`). On tiny GPT-2 and Llama (16 × 64 tokens)
  this prices 8.8 and 7.8 MB kept for backward where the compiled programs keep 9.3 and
  8.2 (eager: 15.4 and 10.4 priced, 15.3 and 9.8 kept), counted by saved-tensor hooks
  (`tests/cost_models/test_fusion.py`).

Unchanged: contractions (their FLOPs, bytes and shapes), attention's kernel,
autocast's casts of a contraction's operands, every collective, pipeline transfers, and
the optimizer step (eager, outside the programs).

On a GPU preset the floors, and the regions' host work, hide behind the kernels queued
before them as launches do eager (`ComputeModel._launched`): what compiling saves there
is the fused runs' memory passes.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import sympy
from torch import fx
from torch.utils import _pytree as pytree

from autopart.ops.aten import VIEW_OPS, op_name
from autopart.ops.meta import SAVED_BYTES, SHAPE, TensorInfo

# A compiled kernel's or library call's floor, over the eager operator's
# (`DeviceSpec.kernel_launch_s`): no fx interpreter, no autograd recording per operator.
COMPILED_FLOOR = 3.0
# What one call of a compiled region costs beyond its kernels, in eager operator floors,
# in forward and again in backward: dynamo's guards, AOTAutograd's runtime wrapper; and
# what each parameter tensor the regions take adds (its guards, its gradient's return).
REGION_FLOORS = 20.0
TENSOR_FLOORS = 1.0
# Operators inductor runs as aten calls (fallbacks) rather than fusing them; the
# contractions (matmuls, attention, convolutions) are library calls as well.
FALLBACKS = frozenset(
    {
        "nonzero",
        "sort",
        "argsort",
        "topk",
        "unique",
        "_unique2",
        "unique_consecutive",
        "multinomial",
        "masked_select",
        "_local_scalar_dense",
        "item",
    }
)
# Nodes that only name (part of) another node's result: a tuple's item, a view.
_PASS_THROUGH = VIEW_OPS | {"getitem"}
_CALLS = ("call_function", "call_method", "call_module")


def is_view(node: fx.Node, gm: fx.GraphModule) -> bool:
    """Whether `node` only names part of another node's result (a view, a tuple's item),
    which a compiled program turns into index arithmetic."""
    return node.op in _CALLS and op_name(node, gm) in _PASS_THROUGH


def fusible_op(node: fx.Node, gm: fx.GraphModule) -> bool:
    """Whether inductor generates `node`'s code into a fused kernel: a call that is not a
    contraction (matmul, attention, convolution) or a fallback."""
    from autopart.cost_models.work import OTHER, op_kind  # work.py imports this module

    if node.op not in _CALLS:
        return False
    name = op_name(node, gm)
    return op_kind(name) == OTHER and name not in FALLBACKS


@dataclass(frozen=True, slots=True)
class Fused:
    """A fused operator's bytes in a compiled program (module docstring): read from
    memory (its parameters included), written to it, and kept for backward."""

    read: sympy.Expr
    written: sympy.Expr
    saved: sympy.Expr


NOTHING = Fused(sympy.Integer(0), sympy.Integer(0), sympy.Integer(0))


def fused_work(gm: fx.GraphModule) -> Mapping[fx.Node, Fused]:
    """Every fused operator of `gm` (views included, at no cost) and its `Fused` bytes;
    kept per graph (the search prices a graph many times)."""
    kept = _KEPT.get(gm.graph)
    if kept is None or kept[0] != len(gm.graph.nodes):
        kept = _KEPT[gm.graph] = (len(gm.graph.nodes), _FusedGraph(gm).work())
    return kept[1]


_KEPT: weakref.WeakKeyDictionary[fx.Graph, tuple[int, dict[fx.Node, Fused]]] = (
    weakref.WeakKeyDictionary()
)


class _FusedGraph:
    """Which operators share a kernel: fused operators at one level, a level being how
    many contractions (or fallbacks) precede a value on its longest path from the
    program's inputs. Two fused operators at one level can run in one kernel; a value
    read at another level, or by a contraction, or returned, is written to memory.

    What backward keeps of a fused run: AOTAutograd's partitioner recomputes the run's
    cheap results in backward instead of saving them, from the values that run reads or
    writes in memory. So an operator that saves something eager keeps, compiled, those
    of its operands (and its own result) that are in memory, each once in the program,
    at most what it saves eager, and none that a contraction already keeps (its saved
    operands)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        nodes = list(gm.graph.nodes)
        self.fusible = {n for n in nodes if fusible_op(n, gm)}
        self.views = {n for n in self.fusible if is_view(n, gm)}
        self.level: dict[fx.Node, int] = {}
        for n in nodes:
            steps = (self.level[a] + self._after(a) for a in n.all_input_nodes)
            self.level[n] = max(steps, default=0)

    def _after(self, node: fx.Node) -> int:
        """1 for what reads a contraction's or fallback's result: a level later."""
        return int(node.op in _CALLS and node not in self.fusible)

    def _base(self, node: fx.Node) -> fx.Node:
        """The node whose memory a view (or tuple item) names."""
        while node in self.views and node.all_input_nodes:
            node = node.all_input_nodes[0]
        return node

    def _readers(self, node: fx.Node) -> Iterator[fx.Node]:
        for user in node.users:
            if user in self.views:
                yield from self._readers(user)
            else:
                yield user

    def written(self, node: fx.Node) -> bool:
        """Whether a fused operator's result goes to memory: read outside its kernel."""
        return any(
            r not in self.fusible or self.level[r] != self.level[node] for r in self._readers(node)
        )

    def in_memory(self, node: fx.Node, reader: fx.Node) -> bool:
        """Whether `reader` finds the value of `node` (a base) in memory."""
        fused_here = node in self.fusible and self.level[node] == self.level[reader]
        return not fused_here and node not in self.views  # a view of nothing: indices

    def materialized(self, node: fx.Node) -> bool:
        """Whether the value of `node` (a base) is in memory at some point: an input, a
        parameter, a contraction's result, or a fused result written."""
        if node not in self.fusible:
            return True
        return node not in self.views and self.written(node)

    def work(self) -> dict[fx.Node, Fused]:
        kept_by_contractions = {
            self._base(a)
            for n in self.level
            if n.op in _CALLS and n not in self.fusible and _saves(n)
            for a in n.all_input_nodes
        }
        claimed: set[fx.Node] = set(kept_by_contractions)
        out: dict[fx.Node, Fused] = {}
        for n in self.level:
            if n not in self.fusible:
                continue
            if n in self.views:
                out[n] = NOTHING
                continue
            operands = dict.fromkeys(self._base(a) for a in _operands(n))
            read = [a for a in operands if self.in_memory(a, n)]
            written = self.written(n)
            saved: sympy.Expr = sympy.Integer(0)
            if _saves(n):
                mine = [
                    a
                    for a in operands
                    if a.op != "get_attr" and a not in claimed and self.materialized(a)
                ]
                if written and n not in claimed:
                    mine.append(n)
                claimed.update(mine)
                saved = sympy.Min(SAVED_BYTES.get(n), sympy.Add(*map(_nbytes, mine)))
            out[n] = Fused(
                sympy.Add(*map(_nbytes, read)),
                _nbytes(n) if written else sympy.Integer(0),
                saved,
            )
        return out


def _operands(node: fx.Node) -> Iterator[fx.Node]:
    for a in pytree.tree_leaves((node.args, node.kwargs)):
        if isinstance(a, fx.Node):
            yield a


def _saves(node: fx.Node) -> bool:
    """Whether the operator saves anything for backward, eager (`passes/saved.py`)."""
    saved = SAVED_BYTES.get(node, 0)
    return saved != 0


def _infos(node: fx.Node) -> tuple[TensorInfo, ...]:
    info = SHAPE.get(node)
    if isinstance(info, TensorInfo):
        return (info,)
    if isinstance(info, (tuple, list)):
        return tuple(i for i in info if isinstance(i, TensorInfo))
    return ()


def _nbytes(node: fx.Node) -> sympy.Expr:
    return sympy.Add(*(i.nbytes for i in _infos(node)))


def regions_per_call(gathers: int) -> int:
    """Compiled regions one call of a stage runs: the stage's graph, cut at each of
    ZeRO-3's `gathers` in it (a gather's start and its wait each break the graph)."""
    return 1 + 2 * gathers
