"""Where the pipeline stages begin: cuts at block boundaries, balanced in FLOPs.

Candidates are the first operators of each block instance ("model.layers.3"),
in graph order; a cut there starts a stage with that block. With F(c) the forward FLOPs
of the operators before candidate c (at the example batch), choosing stages-1 candidates
c1 < c2 < ... splits the graph into stages costing F(c1), F(c2) - F(c1), ..., total -
F(c_last). A dynamic program over (stages so far, last cut) minimizes the costliest stage,
the one that sets the pipeline's pace; ties go to the earliest cuts, so the answer is
deterministic. What lies outside the blocks (embeddings, the output head) counts toward
the first and last stages.
"""

from __future__ import annotations

import sympy
from torch import fx

from autopart.ops.meta import BLOCK, FLOPS, SHAPE, TensorInfo
from autopart.plan import PlanError


def choose_stage_cuts(gm: fx.GraphModule, stages: int) -> tuple[str, ...]:
    """Module paths where stages 1 .. stages-1 begin (needs the analysis passes' FLOPS
    and BLOCK meta)."""
    if stages == 1:
        return ()
    names, before, total = _candidates(gm)
    if len(names) < stages - 1:
        raise PlanError(
            f"{stages} pipeline stages need {stages - 1} cuts between blocks (the layers of "
            f"the model's main stack), but the model has {len(names)} block boundaries: use "
            "fewer stages (pp × "
            "virtual_stages), or plan with pp=1 and set the cuts yourself with "
            "plan.with_changes(pp=..., schedule=..., stage_cuts=(module paths ...))"
        )
    return tuple(names[i] for i in _balanced_cuts(before, total, stages))


def _candidates(gm: fx.GraphModule) -> tuple[list[str], list[float], float]:
    """Each block instance's path, the FLOPs of everything before it, and the total."""
    values = _example_sizes(gm)
    names: list[str] = []
    before: list[float] = []
    total = 0.0
    for node in gm.graph.nodes:
        block = BLOCK.get(node)
        if block is not None and block.instance not in names:
            names.append(block.instance)
            before.append(total)
        total += float(sympy.sympify(FLOPS.get(node)).xreplace(values))
    return names, before, total


def _balanced_cuts(before: list[float], total: float, stages: int) -> list[int]:
    """Indices of stages-1 candidates minimizing the largest stage's FLOPs."""
    n = len(before)
    # best[s][j]: the least possible largest cost of s stages ending at candidate j
    # (stage s+1 begins at j), with the cut list that achieves it.
    best: list[list[tuple[float, list[int]]]] = [[(before[j], [j]) for j in range(n)]]
    for _ in range(stages - 2):
        prev = best[-1]
        row = []
        for j in range(n):
            options = [(max(prev[i][0], before[j] - before[i]), prev[i][1] + [j]) for i in range(j)]
            row.append(min(options, default=(float("inf"), [])))
        best.append(row)
    finals = [(max(cost, total - before[j]), cuts) for j, (cost, cuts) in enumerate(best[-1])]
    return min(finals)[1]


def _example_sizes(gm: fx.GraphModule) -> dict[sympy.Symbol, int]:
    """The named dims at the example inputs: each input's SHAPE (named) against its
    fake value's sizes (the example's, as hints)."""
    sizes: dict[sympy.Symbol, int] = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        info, val = SHAPE.get(node), node.meta.get("val")
        if not isinstance(info, TensorInfo) or val is None:
            continue
        for dim, size in zip(info.shape, val.shape):
            if isinstance(dim, sympy.Symbol):
                sizes[dim] = size.node.hint if hasattr(size, "node") else int(size)
    return sizes
