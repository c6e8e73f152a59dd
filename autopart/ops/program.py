"""What the rewrite hands the runtime: this rank's program."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import fx


@dataclass
class RankProgram:
    """This rank's stage graphs: the whole graph when pp = 1; with a pipeline, the
    stages this rank runs (several under an interleaved schedule), by stage index."""

    stages: list[fx.GraphModule]
    stage_ids: list[int]
    # Tensor-parallel parameters: FQN -> (sharded dim, parts of a fused weight).
    tp_layout: dict[str, tuple[int, int]] = field(default_factory=dict)
