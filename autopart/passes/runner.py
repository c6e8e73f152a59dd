"""The pass contract and the runner that applies a list of passes.

Every pass is `def <name>_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule`.
Analysis passes annotate `node.meta` and return `gm` unchanged; rewrite passes return
the rewritten module. The runner times each pass and skips those named in
`ctx.disabled`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from torch import fx

log = logging.getLogger("autopart.passes")

Pass = Callable[[fx.GraphModule, "PassContext"], fx.GraphModule]


@dataclass
class PassContext:
    """What passes share: how symbolic sizes map to named dims, which attributes are
    parameters, and whatever a rewrite pass needs from the plan (`options`)."""

    # The exporter's shape-environment symbols -> the named dims ("batch", "seq").
    symbols: Mapping[sympy.Symbol, sympy.Symbol] = field(default_factory=dict)
    # Attribute path in the graph module -> canonical parameter FQN (tied weights share one).
    params: Mapping[str, str] = field(default_factory=dict)
    disabled: frozenset[str] = frozenset()
    options: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

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
            log.info("pass %s disabled", name)
            continue
        start = time.perf_counter()
        gm = p(gm, ctx)
        ctx.timings[name] = time.perf_counter() - start
        log.debug("pass %s took %.3fs", name, ctx.timings[name])
    return gm
