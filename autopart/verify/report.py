"""What `autopart.verify` reports: the largest differences from one device, and the
first operator that diverges."""

from __future__ import annotations

from dataclasses import dataclass, field

# A difference beyond these is a mismatch: fp32 reductions in another order stay orders
# of magnitude below them; a missing collective or a wrong scale is O(1).
LOSS_RTOL = 1e-4
TENSOR_RTOL = 1e-3


@dataclass(frozen=True, slots=True)
class Divergence:
    """An operator whose output differs from one device's."""

    module_path: str
    op: str
    node: str
    difference: float

    def __str__(self) -> str:
        where = self.module_path or "(the model's top level)"
        return f"{where}: {self.op} (node {self.node}), relative difference {self.difference:.3g}"


@dataclass(frozen=True, slots=True)
class VerifyReport:
    plan: str
    world: int
    steps: int
    loss: float  # largest relative difference over the steps
    outputs: float
    gradients: dict[str, float]
    compared: int  # operators whose outputs were set side by side
    not_compared: int  # recomputed or not reassembled
    first_divergence: Divergence | None
    losses: list[float] = field(default_factory=list)
    reference_losses: list[float] = field(default_factory=list)

    @property
    def worst_gradient(self) -> tuple[str, float]:
        return max(self.gradients.items(), key=lambda kv: kv[1], default=("", 0.0))

    @property
    def ok(self) -> bool:
        return (
            self.loss <= LOSS_RTOL
            and self.outputs <= TENSOR_RTOL
            and self.worst_gradient[1] <= TENSOR_RTOL
            and self.first_divergence is None
        )

    def __str__(self) -> str:
        name, worst = self.worst_gradient
        verdict = "matches one device" if self.ok else "DOES NOT match one device"
        return "\n".join(
            [
                f"autopart verify: {self.plan} on {self.world} Gloo processes, {self.steps} steps",
                f"  loss        {self.loss:.2e}  (largest relative gap; limit {LOSS_RTOL:g})",
                f"  outputs     {self.outputs:.2e}  (limit {TENSOR_RTOL:g})",
                f"  gradients   {worst:.2e}  ({name or 'none'}; limit {TENSOR_RTOL:g})",
                f"  operators   {self.compared} compared, {self.not_compared} not comparable",
                f"  first divergence: {self.first_divergence or 'none'}",
                f"the plan {verdict}",
            ]
        )
