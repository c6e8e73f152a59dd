"""The training loop's options: how a step clips, which batch each rank passes, what a
step with a non-finite loss does, and whether the programs run compiled. The first
three never change the plan: a plan made with them and without them is the same plan.
`compile` is the plan's own: `parallelize(..., compile=True)` pins it
(`Pins.compile`), the plan records it (`Plan.compiled`) and the cost models price the
compiled programs (`Choices.compiled`, `cost_models/fusion.py`); this option carries
`Plan.compiled` to the runtime.

    max_grad_norm   clip the gradients to this global norm (over the whole model,
                    every shard and stage counted once), as torch.nn.utils.clip_grad_norm_
                    does on one device; `pm.grad_norm` holds the norm before clipping
    batch           "global": every rank passes the global batch (autopart's default);
                    "per_rank": each data-parallel rank passes its own share, as under DDP
                    with a DistributedSampler
    skip_nonfinite  a step whose loss or gradient norm is inf or NaN is skipped either
                    way (parameters and optimizer state untouched); by default every rank
                    then raises NonFiniteLoss, with this set it counts the step and goes on
    compile         run each rank's programs compiled by inductor (runtime/compiled.py),
                    as `Plan.compiled` says
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from autopart.policy import check_choice


class BatchConvention(StrEnum):
    GLOBAL = "global"
    PER_RANK = "per_rank"


class NonFiniteLoss(FloatingPointError):
    """A training step whose loss or gradient norm was inf or NaN. The step was skipped
    on every rank: the parameters and the optimizer state are as before it."""

    def __init__(self, step: int, loss: float, grad_norm: float) -> None:
        self.step, self.loss, self.grad_norm = step, loss, grad_norm
        super().__init__(
            f"training step {step} has loss {loss} and gradient norm {grad_norm}: the step "
            "was skipped, parameters and optimizer state are as before it. Lower the "
            "learning rate, clip (max_grad_norm=1.0), or pass skip_nonfinite=True to "
            "parallelize to skip such steps and go on (pm.skipped_steps counts them)"
        )


class ConventionMismatch(ValueError):
    """The ranks' inputs do not follow the batch convention the module was built for."""


@dataclass(frozen=True, slots=True)
class TrainingOptions:
    max_grad_norm: float | None = None
    batch: BatchConvention | str = BatchConvention.GLOBAL
    skip_nonfinite: bool = False
    compile: bool = False

    def __post_init__(self) -> None:
        problem = check_choice(BatchConvention, self.batch, "batch")
        if problem:
            raise ValueError(
                f"{problem}: 'global' when every rank passes the global batch, 'per_rank' "
                "when each data-parallel rank passes its own share (DDP's convention)"
            )
        norm = self.max_grad_norm
        if norm is not None and not (math.isfinite(norm) and norm > 0):
            raise ValueError(f"max_grad_norm must be a positive number, not {norm!r}")

    @property
    def per_rank(self) -> bool:
        return self.batch == BatchConvention.PER_RANK
