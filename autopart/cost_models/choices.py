"""What a plan decides that its costs depend on (`Choices`), and the models that price
it (`CostModels`): what `predict`, the search's floors and the inner stage model read."""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TypeVar

from torch import fx
from torch.distributed.tensor import Placement

from autopart.cost_models.comm import CommModel
from autopart.cost_models.compute import ComputeModel
from autopart.cost_models.memory import MemoryModel, state_bytes
from autopart.cost_models.summary import SegmentWork, TpLayout
from autopart.degrees import Axis, AxisAttributes, Degrees
from autopart.mesh import Mesh
from autopart.plan import Plan
from autopart.policy import (
    PARAM_DTYPES,
    SCHEDULES,
    MasterWeights,
    cp_gradients_in_sync,
    outer_optimizer,
)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Choices(AxisAttributes):
    """What a plan decides that the costs depend on (the fields of `Plan`);
    `choices.dp`, `choices.tp`, ... read `choices.degrees`."""

    global_batch: int
    degrees: Degrees = field(default_factory=Degrees)
    zero: int = 0
    microbatches: int = 1
    schedule: str | None = None
    virtual_stages: int = 1
    precision: str = "fp32"
    recompute: tuple[str, ...] = ()  # module paths of recomputed blocks (or containers)
    # Module paths of blocks (or containers) whose attention core alone is recomputed.
    recompute_attention: tuple[str, ...] = ()
    stage_cuts: tuple[str, ...] = ()
    # (FQN, tp placement) of every parameter; None: the Megatron layout (summary.py).
    tp_placements: tuple[tuple[str, Placement], ...] | None = None
    sequence_parallel: bool = False
    grad_compression: str | None = None  # as the runtime compresses the dp all-reduce
    offload: bool = False  # the optimizer state on the host, stepped there
    # Local SGD's steady state: parameters averaged every `sync_every` steps instead
    # of gradients all-reduced every step (its warm-up is priced as data parallelism).
    sync_every: int | None = None
    # Copies of the parameters local SGD's outer optimizer keeps: its anchor, and its
    # momentum where it has one.
    outer_copies: int = 0
    # Where the fp32 weights live (`policy.MasterWeights`): on the host, the device's
    # weights and gradients are 16-bit.
    master_weights: str = MasterWeights.DEVICE
    # Batch norms normalize each part of the batch by its own statistics (taking the
    # first replica's running ones), not by the whole batch's over the replicas
    # (`passes/batch_norm.py`).
    per_part_statistics: bool = False
    # Under 16-bit parameters: the dtype gradients are reduced in (`Plan.reduce_dtype`).
    reduce_dtype: str = "fp32"
    # What the loss reads of a batch × batch product (`Plan.batch_product_loss`): "rows"
    # gathers only its columns' side over the replicas, "whole" (or None) both.
    batch_product_loss: str | None = None
    # Each rank's programs compiled by inductor (`Plan.compiled`, `fusion.py`).
    compiled: bool = False

    def __post_init__(self) -> None:
        if self.pp > 1 and self.schedule is None:
            raise ValueError("a pipeline (pp > 1) needs a schedule: one of " + ", ".join(SCHEDULES))

    @classmethod
    def of(cls, plan: Plan) -> Choices:
        placements = tuple((fqn, plan.placement(fqn, Axis.TP)) for fqn in sorted(plan.placements))
        return cls(
            plan.global_batch,
            plan.degrees,
            plan.zero,
            plan.microbatches,
            plan.schedule,
            plan.virtual_stages,
            plan.precision,
            plan.recompute,
            plan.recompute_attention,
            plan.stage_cuts,
            placements if plan.tp > 1 and placements else None,
            plan.sequence_parallel,
            plan.grad_compression,
            plan.offload,
            plan.sync_every,
            _outer_copies(plan.outer_optimizer),
            plan.master_weights,
            plan.per_part_statistics,
            plan.reduce_dtype,
            plan.batch_product_loss,
            plan.compiled,
        )

    @property
    def state_bytes(self) -> tuple[int, int, int]:
        """Bytes per parameter of its (weights, gradients, optimizer state)."""
        return state_bytes(self.precision, self.master_weights)

    @property
    def reduced_grad_bytes(self) -> int:
        """Bytes per parameter a data-parallel gradient reduction moves: what the
        gradients are held in, but for 16-bit parameters reduced in bf16."""
        held = self.state_bytes[1]
        return 2 if self.precision in PARAM_DTYPES and self.reduce_dtype == "bf16" else held

    def tp_layout(self, gm: fx.GraphModule) -> TpLayout | None:
        if self.tp == 1 or self.tp_placements is None:
            return None
        return TpLayout.of(gm, dict(self.tp_placements), self.tp, self.sequence_parallel)

    @property
    def microbatch_size(self) -> int:
        parts = self.degrees.batch_split * self.microbatches
        if self.global_batch % parts:
            raise ValueError(
                f"the global batch of {self.global_batch} does not split into "
                f"dp={self.dp} × ep={self.ep} × microbatches={self.microbatches} equal parts"
            )
        return self.global_batch // parts

    @property
    def chunks(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def cp_in_sync(self) -> bool:
        """Whether the gradient sync sums context parallelism's parts
        (`policy.cp_gradients_in_sync`), not an all-reduce per microbatch."""
        return cp_gradients_in_sync(self.zero, self.sync_every, self.grad_compression)

    def recomputes(self, segment: SegmentWork) -> bool:
        """Whether a block lies in (or is) one of the recomputed module paths."""
        # The search asks this of every segment of every plan: most recompute nothing.
        return bool(self.recompute) and segment.is_block and self.recomputes_block(segment.key)

    def recomputes_block(self, key: str) -> bool:
        """Whether the block instance `key` lies in (or is) a recomputed module path."""
        return _within(key, self.recompute)

    def recomputes_attention(self, segment: SegmentWork) -> bool:
        """Whether only a block's attention core is recomputed (selective)."""
        return (
            bool(self.recompute_attention)
            and segment.is_block
            and _within(segment.key, self.recompute_attention)
            and segment.has_attention_core
            and not self.recomputes(segment)
        )


def _outer_copies(spec: str | None) -> int:
    if spec is None:
        return 0
    return 2 if outer_optimizer(spec).momentum else 1


def _within(key: str, paths: tuple[str, ...]) -> bool:
    """Whether module path `key` lies in (or is) one of `paths`: one set look-up per
    prefix of it, as the search asks it of every block."""
    if not paths:
        return False
    chosen = _as_set(paths)
    parts = key.split(".")
    return any(".".join(parts[:i]) in chosen for i in range(1, len(parts) + 1))


@functools.lru_cache(maxsize=256)
def _as_set(paths: tuple[str, ...]) -> frozenset[str]:
    return frozenset(paths)


@dataclass(frozen=True, slots=True)
class CostModels:
    """The models a prediction uses, passed explicitly. `remembered`: what they worked
    out that other plans priced with them share (`remember`): a search prices
    thousands of plans with one set of models."""

    compute: ComputeModel
    comm: CommModel
    memory: MemoryModel
    remembered: dict = field(default_factory=dict, compare=False, repr=False)

    def remember(self, key: Hashable, make: Callable[[], T]) -> T:
        """`make()`, worked out once per `key` for every plan these models price (a
        rank's columns, sends and ZeRO-3 tallies, `predict`). A key naming an object by
        its id belongs to an entry that keeps the object, so the id is not reused."""
        if key not in self.remembered:
            self.remembered[key] = make()
        return self.remembered[key]

    @classmethod
    def of(cls, mesh: Mesh, precision: str, compiled: bool = False) -> CostModels:
        """The models of a plan at `precision` on `mesh`, its programs run eagerly or,
        where `compiled`, compiled by inductor (`fusion.py`)."""
        device = mesh.device
        compute = ComputeModel(device, precision, device.matmul_half_dim, compiled)
        return cls(compute, CommModel(mesh), MemoryModel(precision))
