"""The Plan: how one model runs on one mesh. Frozen data, versioned JSON.

A plan names parameters by FQN and operators by module path + op, never by fx.Node, so
it can be printed, edited, saved, diffed and loaded into a new process. It carries the
mesh it was made for and a fingerprint of the model; loading it for another model or
mesh is an error that says which.

Placements use PyTorch's vocabulary (`Shard(dim)`, `Replicate()`, `Partial()`), one per
placement axis in `PLACEMENT_AXES` order (dp, tp); pipeline stages are given by cuts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

from torch.distributed.tensor import Placement, Replicate

from autopart.degrees import Axis, AxisAttributes, Degrees, MeshError
from autopart.mesh import Mesh
from autopart.placements import placement_from_str, placement_to_str
from autopart.plan_format import PLACEMENT_AXES, diff_plans, explain_plan, format_plan
from autopart.policy import (
    Precision,
    Schedule,
    check_choice,
    master_weights_refusal,
    offload_refusal,
    outer_optimizer_refusal,
    param_dtype_refusal,
    replica_opt_in_refusal,
)

PLAN_VERSION = 1


class PlanError(ValueError):
    """A plan that is inconsistent, or used with a model or mesh it was not made for."""


# ---------------------------------------------------------------------------------------
# The parts of a plan


@dataclass(frozen=True, slots=True)
class MeshSpec:
    device: str
    nodes: int
    per_node: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node

    @classmethod
    def of(cls, mesh: Mesh) -> MeshSpec:
        return cls(mesh.device.name, mesh.nodes, mesh.per_node)

    def __str__(self) -> str:
        return f"{self.nodes}×{self.per_node} {self.device}"


@dataclass(frozen=True, slots=True)
class StageFigures:
    """One pipeline rank as the cost models see it (the whole model when pp = 1)."""

    blocks: int  # repeated blocks it runs
    microbatch_s: float  # compute and critical-path communication per microbatch
    peak_memory_bytes: int
    in_flight: float  # microbatches whose activations it holds at once
    recomputed: int = 0  # blocks recomputed in backward
    recompute_frees_bytes: int = 0  # activation bytes that recomputation frees
    recompute_s: float = 0.0  # what recomputation adds to each step
    tp_comm_s: float = 0.0  # tensor-parallel collectives per step (resharding activations)
    attention_recomputed: int = 0  # blocks whose attention core alone is recomputed
    ep_comm_s: float = 0.0  # expert-parallel all_to_alls per step (routed rows)


@dataclass(frozen=True, slots=True)
class Resharding:
    """Tensor-parallel collectives the layout inserts at one operator, over every copy of
    its block: what they move and cost per step, summed over the pipeline's stages."""

    where: str  # the operator's module path, a repeated block's index as "*"
    operator: str  # the operator it serves ("linear", "embedding", "output", ...)
    collective: str  # "all_reduce", "all_gather", ...
    backward: bool  # in backward (else forward, and again where recomputed)
    count: int  # per step
    bytes_each: int
    seconds: float  # per step, all of them


@dataclass(frozen=True, slots=True)
class Predicted:
    """What the cost models expect of the plan, per rank (the largest where they differ)."""

    step_time_s: float
    compute_s: float
    exposed_comm_s: float
    bubble_s: float
    peak_memory_bytes: int
    memory: Mapping[str, int] = field(default_factory=dict)  # parameters, gradients, ...
    model_flops_per_device: float = 0.0  # achieved model FLOP/s per device
    stages: tuple[StageFigures, ...] = ()  # per pipeline rank
    resharding: tuple[Resharding, ...] = ()  # the tp collectives, costliest first
    compiled: bool = False  # priced as programs compiled by inductor (else eager)


@dataclass(frozen=True, slots=True)
class Alternative(AxisAttributes):
    """A ranked runner-up: what it switches on, and its predicted step time and memory."""

    degrees: Degrees
    zero: int
    microbatches: int
    schedule: str | None
    step_time_s: float
    peak_memory_bytes: int
    note: str = ""
    virtual_stages: int = 1
    sequence_parallel: bool = False
    recompute: int = 0  # blocks recomputed whole
    recompute_attention: int = 0  # blocks whose attention core alone is recomputed
    offload: bool = False


@dataclass(frozen=True, slots=True)
class Plan(AxisAttributes):
    """How one model runs on one mesh. `plan.dp`, `plan.tp`, ... read `plan.degrees`."""

    mesh: MeshSpec
    fingerprint: str  # of the model's parameters (names, shapes, dtypes)
    global_batch: int
    degrees: Degrees = field(default_factory=Degrees)
    zero: int = 0
    microbatches: int = 1
    schedule: str | None = None
    virtual_stages: int = 1
    precision: str = "fp32"
    sequence_parallel: bool = False  # tp activations between blocks sharded on the sequence
    # Local SGD (opt-in; it changes the math): after `sync_warmup` steps of plain data
    # parallelism, replicas step on their own gradients and average their parameters
    # every `sync_every` steps. None: plain data parallelism (gradients all-reduced).
    sync_every: int | None = None
    sync_warmup: int = 0
    # Local SGD's outer optimizer ("sgd:lr=0.7,momentum=0.9,nesterov": policy.py), which
    # steps the parameters by the replicas' mean; None: the mean itself.
    outer_optimizer: str | None = None
    # The model's statistics over its batch (a load-balancing loss) taken over each
    # part's examples (dp × ep ranks, microbatches), as asked (it changes the math).
    per_part_statistics: bool = False
    # Where the batch is split over replicas and the model scores it against itself (a
    # batch × batch product, gathered over the replicas: passes/batch_products.py), what
    # the loss gets: "rows", each replica's rows of the product (a loss that is a mean
    # over them); "whole", the whole product and target on every replica. None: no such
    # product, or the batch is whole.
    batch_product_loss: str | None = None
    # ZeRO offload: the optimizer state lives in host memory and the optimizer steps
    # there (ZeRO's shards, or a single replica's whole state). The solver offloads
    # only where no plan fits without it.
    offload: bool = False
    # Why the solver offloaded: what the smallest plan keeping the optimizer state on
    # the device would need ("" where pinned, or not offloaded).
    offload_reason: str = ""
    # Where the fp32 weights live under mixed precision (opt-in; it changes the math):
    # "device", the parameters themselves; "host", the offloaded optimizer's copies,
    # the device holding 16-bit copies whose gradients are 16-bit too.
    master_weights: str = "device"
    # Under precision "bf16-params": what the data-parallel gradients are reduced in
    # (FSDP2's reduce_dtype): "fp32" (the 16-bit gradients widened first) or "bf16".
    reduce_dtype: str = "fp32"
    # Why the solver chose this precision where the pin left it a choice of modes
    # (`policy.PRECISION_CHOICES`): how the modes' plans compared ("" where pinned).
    precision_reason: str = ""
    # Each rank's programs compiled by inductor (`parallelize(..., compile=True)`): the
    # predictions price them fused (`cost_models/fusion.py`); False: run eagerly.
    compiled: bool = False
    # Opt-in compression of the data-parallel gradient all-reduce (it changes the math):
    # "bf16" or "powersgd:rank=R" (`runtime.grad_compression`); None: exact.
    grad_compression: str | None = None
    recompute: tuple[str, ...] = ()  # module paths of blocks recomputed in backward
    # Module paths of blocks whose attention core alone is recomputed (selective).
    recompute_attention: tuple[str, ...] = ()
    placements: Mapping[str, tuple[Placement, ...]] = field(default_factory=dict)
    # What each tp-sharded parameter does under the layout ("column-parallel", ...).
    tp_roles: Mapping[str, str] = field(default_factory=dict)
    # The stacked expert weights ep splits, each rank holding a run of the experts (dim
    # 0) of every routed layer, as the rewrite finds them (`passes/experts.py`).
    ep_params: tuple[str, ...] = ()
    stage_cuts: tuple[str, ...] = ()  # module paths where stages 1, 2, ... begin
    predicted: Predicted | None = None
    alternatives: tuple[Alternative, ...] = ()
    # The plan was edited (`with_changes`) after `predicted` and the alternatives were
    # made: they describe the plan before the edit. Pricing needs the captured graph,
    # which a plan does not hold; planning again with the edit pinned prices it.
    predictions_stale: bool = False
    version: int = PLAN_VERSION

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise PlanError("invalid plan: " + "; ".join(problems))

    def problems(self) -> list[str]:
        out: list[str | None] = []
        if self.degrees.world_size != self.mesh.world_size:
            out.append(
                f"{self.degrees.product()} does not cover the "
                f"{self.mesh.world_size} devices of {self.mesh}"
            )
        if self.zero not in (0, 1, 2, 3):
            out.append(f"zero must be 0, 1, 2 or 3, not {self.zero}")
        out.append(check_choice(Precision, self.precision, "precision"))
        if self.schedule is not None:
            out.append(check_choice(Schedule, self.schedule, "schedule"))
        if self.sync_warmup < 0:
            out.append(f"sync_warmup must be at least 0, not {self.sync_warmup}")
        out.append(replica_opt_in_refusal(self.zero, self.sync_every, self.grad_compression))
        out.append(outer_optimizer_refusal(self.outer_optimizer, self.sync_every))
        if self.offload:
            out.append(offload_refusal(self.zero, self.dp, self.cp, self.ep))
        out.append(master_weights_refusal(self.master_weights, self.offload, self.precision))
        out.append(
            param_dtype_refusal(
                self.precision,
                self.reduce_dtype,
                self.dp * self.ep,
                self.cp,
                self.zero,
                self.offload,
                self.sync_every is not None,
                self.grad_compression is not None,
            )
        )
        if self.sequence_parallel and self.tp == 1:
            out.append("sequence parallelism needs tp > 1")
        if self.pp > 1 and self.schedule is None:
            out.append("a pipeline (pp > 1) needs a schedule")
        if self.pp > 1 and len(self.stage_cuts) != self.pp * self.virtual_stages - 1:
            out.append(
                f"{self.pp * self.virtual_stages} pipeline stages need "
                f"{self.pp * self.virtual_stages - 1} stage cuts, got {len(self.stage_cuts)}"
            )
        if self.microbatches < 1 or self.global_batch % (self.dp * self.microbatches):
            out.append(
                f"the global batch of {self.global_batch} does not split into dp={self.dp} "
                f"× microbatches={self.microbatches} equal parts"
            )
        for fqn, ps in self.placements.items():
            if len(ps) != len(PLACEMENT_AXES):
                out.append(f"{fqn} needs one placement per axis {[str(a) for a in PLACEMENT_AXES]}")
        return [p for p in out if p is not None]

    # -- use ------------------------------------------------------------------------------

    def check_compatible(self, fingerprint: str, mesh: Mesh) -> None:
        """Fail clearly if this plan was made for another model or mesh."""
        if fingerprint != self.fingerprint:
            raise PlanError(
                f"this plan was made for another model (fingerprint {self.fingerprint}, "
                f"this model's is {fingerprint}): its parameter names, shapes or dtypes "
                "differ. Make a new plan with autopart.plan(model, mesh, ...)"
            )
        here = MeshSpec.of(mesh)
        if here.world_size != self.mesh.world_size or here.device != self.mesh.device:
            raise PlanError(
                f"this plan was made for the mesh {self.mesh} ({self.mesh.world_size} "
                f"devices) but is used on {here} ({here.world_size} devices): make a new "
                "plan for this mesh"
            )

    def placement(self, fqn: str, axis: Axis) -> Placement:
        ps = self.placements.get(fqn)
        return ps[PLACEMENT_AXES.index(axis)] if ps else Replicate()

    @property
    def tp_shards_nothing(self) -> bool:
        """tp > 1 with every parameter whole and no sequence split: each tp rank runs the
        whole step on the same samples, with no collective between them."""
        return (
            self.tp > 1
            and not self.sequence_parallel
            and all(self.placement(fqn, Axis.TP).is_replicate() for fqn in self.placements)
        )

    def with_changes(self, **changes: Any) -> Plan:
        """A copy with some fields changed (validated again): how a user edits a plan.
        Axes are changed by name: `plan.with_changes(dp=4, tp=2)`. The predictions stay
        those of the plan before the edit, marked stale (`predictions_stale`), unless
        the changes give new ones."""
        axes = {k: changes.pop(k) for k in self.degrees.names if k in changes}
        if axes:
            changes["degrees"] = changes.get("degrees", self.degrees).replace(**axes)
        if "placements" in changes:  # the roles described the layout being replaced
            changes.setdefault("tp_roles", {})
        if "predicted" in changes:
            changes.setdefault("predictions_stale", False)
        elif _edits(self, changes):
            changes.setdefault("predictions_stale", self.predicted is not None)
        return replace(self, **changes)

    # -- text -----------------------------------------------------------------------------

    def __str__(self) -> str:
        return format_plan(self)

    def explain(self) -> str:
        """The plan's choices and predictions in sentences."""
        return explain_plan(self)

    def diff(self, other: Plan) -> list[str]:
        return diff_plans(self, other)

    # -- JSON -----------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "placements":
                value = {k: [placement_to_str(p) for p in v] for k, v in value.items()}
            elif f.name in ("mesh", "predicted"):
                value = None if value is None else _dataclass_dict(value)
            elif f.name == "alternatives":
                value = [_dataclass_dict(a) for a in value]
            elif f.name == "degrees":
                data.update(value.to_json())  # one key per axis, "dp": 2, ...
                continue
            elif isinstance(value, tuple):
                value = list(value)
            data[f.name] = value
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Plan:
        version = data.get("version")
        if version != PLAN_VERSION:
            raise PlanError(
                f"plan file version {version} is not supported (this autopart reads version "
                f"{PLAN_VERSION}): make the plan again with this version"
            )
        d = dict(data)
        d["degrees"] = _degrees(d)
        d["mesh"] = MeshSpec(**d["mesh"])
        d["placements"] = {
            k: tuple(placement_from_str(p) for p in v) for k, v in d.get("placements", {}).items()
        }
        d.pop("strategies", None)  # an always-empty field that earlier plan files carry
        d["predicted"] = _predicted(d["predicted"]) if d.get("predicted") else None
        d["alternatives"] = tuple(_alternative(a) for a in d.get("alternatives", []))
        for key in ("recompute", "recompute_attention", "stage_cuts", "ep_params"):
            d[key] = tuple(d.get(key, ()))
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise PlanError(f"unknown plan fields {sorted(unknown)}")
        return cls(**d)

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        if not Path(path).is_file():
            raise PlanError(f"no plan file at {path}: write one with plan.save(path)")
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise PlanError(f"{path} is not a plan file (not JSON: {e})") from e
        return cls.from_json(data)


# Fields that say what was predicted of a plan, not how it runs: changing them leaves
# its predictions as they are.
PREDICTION_FIELDS = frozenset(
    {"predicted", "alternatives", "offload_reason", "precision_reason", "predictions_stale"}
)


def _edits(plan: Plan, changes: Mapping[str, Any]) -> bool:
    """Whether `changes` change how `plan` runs."""
    return any(
        k not in PREDICTION_FIELDS and getattr(plan, k, None) != v for k, v in changes.items()
    )


def _degrees(data: dict[str, Any]) -> Degrees:
    """Take the axes' degrees out of a plan's (or an alternative's) JSON."""
    axes = {k: data.pop(k) for k in Degrees().names if k in data}
    try:
        return Degrees(axes)
    except MeshError as e:
        raise PlanError(f"invalid plan file: {e}") from None


def _predicted(data: Mapping[str, Any]) -> Predicted:
    rest = dict(data)
    stages = tuple(StageFigures(**s) for s in rest.pop("stages", ()))
    resharding = tuple(Resharding(**r) for r in rest.pop("resharding", ()))
    return Predicted(**rest, stages=stages, resharding=resharding)


def _alternative(data: Mapping[str, Any]) -> Alternative:
    rest = dict(data)
    return Alternative(degrees=_degrees(rest), **rest)


def _dataclass_dict(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, Degrees):
            out.update(value.to_json())
        else:
            out[f.name] = _plain(value)
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if is_dataclass(value) and not isinstance(value, type):
        return _dataclass_dict(value)
    return value
