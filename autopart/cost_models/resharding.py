"""Where a plan's tensor-parallel layout reshards, and what that costs: for
`plan.explain()`, one record per operator and collective, over every copy of a block.

The figures are `predict`'s (`tp_comm`): each collective at the plan's microbatch size,
activations in 16 bits under mixed precision, forward ones again in recomputed blocks,
times the microbatches of a step. They are summed over the whole model, so over the
pipeline's stages; each stage pays its own blocks' share.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from torch import fx

from autopart.cost_models.choices import Choices, CostModels
from autopart.cost_models.precision import is_mixed
from autopart.cost_models.summary import BATCH, GraphSummary
from autopart.ops.aten import op_name
from autopart.ops.meta import BLOCK, MODULE_PATH
from autopart.plan import Resharding


def resharding(
    summary: GraphSummary,
    choices: Choices,
    models: CostModels,
    dims: Mapping[str, int] | None = None,
) -> tuple[Resharding, ...]:
    """The plan's tp collectives by operator, costliest first (none without tp)."""
    tp = choices.tp
    if tp == 1:
        return ()
    mixed = is_mixed(choices.precision)
    at = {**(dims or {}), BATCH: choices.microbatch_size}
    counts: dict[tuple[str, str, str, bool, int], int] = defaultdict(int)
    for segment, site, c, nbytes in summary.collective_sites(at):
        block = segment.block_id is not None
        recomputed = block and not c.backward and choices.recomputes_block(segment.key)
        size = round(nbytes * (c.mixed_scale if mixed else 1.0))
        counts[(_where(site), op_name(site, summary.gm) or site.op, c.op, c.backward, size)] += (
            1 + recomputed
        )
    out = [
        Resharding(
            where,
            operator,
            collective,
            backward,
            n * choices.microbatches,
            size,
            n * choices.microbatches * models.comm.time(collective, size, tp),
        )
        for (where, operator, collective, backward, size), n in counts.items()
    ]
    return tuple(sorted(out, key=lambda r: -r.seconds))


def _where(site: fx.Node) -> str:
    """The operator's module path, a repeated block's index as "*"."""
    path = MODULE_PATH.get(site, "") if site.op != "output" else "(the graph's outputs)"
    block = BLOCK.get(site, None)
    if block is not None and path.startswith(block.instance):
        parent = block.instance.rpartition(".")[0]
        path = (parent + ".*" if parent else "*") + path[len(block.instance) :]
    return path
