"""The pass contract and the runner that applies a list of passes.

Every pass is `def <name>_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule`.
Analysis passes annotate `node.meta` and return `gm` unchanged; rewrite passes return
the rewritten module, with what they decided for the whole graph under a `GraphKey` of
its `gm.meta` (ops/meta.py). Rewrite passes read the plan and this rank's place on the
mesh from `ctx.target`. The runner times each pass and skips those named in
`ctx.disabled`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import sympy
import torch
from torch import fx

if TYPE_CHECKING:
    from autopart.ops.groups import MeshGroups
    from autopart.ops.loss_match import CrossEntropy
    from autopart.passes.materialize import Weights
    from autopart.plan import Plan

log = logging.getLogger("autopart.passes")

Pass = Callable[[fx.GraphModule, "PassContext"], fx.GraphModule]


@dataclass(frozen=True, slots=True)
class RankTarget:
    """What rewrite passes build: this rank's program of `plan`, on its place in the mesh,
    with real memory for a meta model's pieces from `weights`. `loss`: the training loss
    where it is a standard cross-entropy of one output, which the tensor-parallel rewrite
    may then leave sharded over the vocabulary (the runtime computes the loss on it)."""

    plan: Plan
    groups: MeshGroups
    weights: Weights | None = None
    loss: CrossEntropy | None = None


@dataclass
class PassContext:
    """What passes share: how symbolic sizes map to named dims, which attributes are
    parameters, the example inputs, and for rewrite passes the rank they build for."""

    # The exporter's shape-environment symbols -> the named dims ("batch", "seq").
    symbols: Mapping[sympy.Symbol, sympy.Symbol] = field(default_factory=dict)
    # Attribute path in the graph module -> canonical parameter FQN (tied weights share one).
    params: Mapping[str, str] = field(default_factory=dict)
    example_args: tuple[Any, ...] | None = None
    target: RankTarget | None = None
    disabled: frozenset[str] = frozenset()
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def rank(self) -> RankTarget:
        """The plan and mesh place a rewrite pass builds for; an error in analysis."""
        if self.target is None:
            raise ValueError("a rewrite pass needs a plan: run it through passes.rewrite")
        return self.target

    def expr(self, size: int | torch.SymInt | sympy.Expr) -> sympy.Expr:
        """A size as a sympy expression of the named dims."""
        if isinstance(size, torch.SymInt):
            expr = size.node.shape_env.replace(size.node.expr)  # apply known equalities
            return sympy.sympify(expr).xreplace(dict(self.symbols))
        if isinstance(size, sympy.Expr):
            return size.xreplace(dict(self.symbols))
        return sympy.Integer(int(size))


def pass_name(p: Pass) -> str:
    return getattr(p, "__name__", type(p).__name__)


def run_passes(gm: fx.GraphModule, ctx: PassContext, passes: Iterable[Pass]) -> fx.GraphModule:
    for p in passes:
        name = pass_name(p)
        if name in ctx.disabled:
            log.debug("pass %s disabled", name)  # a program made again skips materialize
            continue
        start = time.perf_counter()
        gm = p(gm, ctx)
        # Summed: a per-stage pass runs once for each of this rank's stages.
        ctx.timings[name] = ctx.timings.get(name, 0.0) + time.perf_counter() - start
        log.debug("pass %s took %.3fs", name, ctx.timings[name])
    return gm
