"""Analysis and rewrite passes over the captured graph, one concern per file.

Every pass follows one contract, `(gm, ctx) -> gm` (see `runner`). `analyze` runs the
analysis passes in dependency order; results are read through the keys in `meta`.
"""

from __future__ import annotations

from torch import fx

from autopart.ops.meta import (
    BLOCK,
    FLOPS,
    MODULE_PATH,
    PARAMS,
    SAVED_BYTES,
    SHAPE,
    TRAFFIC,
    AnalysisMissing,
    BlockInfo,
    TensorInfo,
    Traffic,
)
from autopart.passes.attention_core import attention_core_pass
from autopart.passes.blocks import blocks_pass
from autopart.passes.flops import flops_pass, total_flops
from autopart.passes.module_path import module_path_pass
from autopart.passes.params import params_pass
from autopart.passes.runner import Pass, PassContext, run_passes
from autopart.passes.saved import saved_for_backward_pass
from autopart.passes.shapes import shape_pass
from autopart.passes.traffic import traffic_pass

ANALYSIS_PASSES: tuple[Pass, ...] = (
    shape_pass,
    module_path_pass,
    params_pass,
    flops_pass,
    traffic_pass,
    blocks_pass,
    attention_core_pass,
    saved_for_backward_pass,
)


def analyze(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Annotate every node with shapes, module path, parameters, FLOPs, bytes moved,
    bytes saved for backward, repeated-block membership and the blocks' attention cores."""
    return run_passes(gm, ctx, ANALYSIS_PASSES)


__all__ = [
    "ANALYSIS_PASSES",
    "BLOCK",
    "FLOPS",
    "MODULE_PATH",
    "PARAMS",
    "SAVED_BYTES",
    "SHAPE",
    "TRAFFIC",
    "AnalysisMissing",
    "BlockInfo",
    "Pass",
    "PassContext",
    "TensorInfo",
    "Traffic",
    "analyze",
    "run_passes",
    "total_flops",
]
