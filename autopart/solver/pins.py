"""The user's pins, and the plan they determine.

A pin left as None is the solver's choice (`solver.search`); a value fixes it. Axes are
pinned by name (`dp=2`, `tp=4`, ...: every axis of `Degrees`).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import fx
from torch.distributed.tensor import Placement, Replicate, Shard

from autopart.batch import batch_size, check_divisible
from autopart.capture import BATCH, Captured
from autopart.cost_models import Choices, CostModels, predict
from autopart.cost_models.resharding import resharding
from autopart.degrees import BATCH_AXES, Axis, Degrees, MeshError, axis_names
from autopart.heap import young_collections_only
from autopart.mesh import Mesh
from autopart.ops.batch_products import WHOLE
from autopart.ops.meta import BLOCK
from autopart.passes.batch_mixing import (
    gathered_products,
    mixing_kinds,
    updates_running_statistics,
)
from autopart.passes.context_parallel import sequence_length
from autopart.plan import Alternative, MeshSpec, Plan, PlanError
from autopart.plan_format import format_bytes
from autopart.policy import (
    MAX_ALTERNATIVES,
    PARAM_DTYPES,
    PRECISION_ALIASES,
    PRECISION_CHOICES,
    MasterWeights,
    Precision,
    ReduceDtype,
    Schedule,
    check_choice,
    master_weights_refusal,
    outer_optimizer_refusal,
    param_dtype_refusal,
    replica_opt_in_refusal,
    zero_refusal,
)
from autopart.solver.pipeline import choose_pipeline
from autopart.solver.search import SLACK, Candidate, NoPlanFits, search
from autopart.solver.tp_layouts import TpLayouts, memory_may_bind

# A recomputation pin's words for "every block" and "none".
RECOMPUTE_WORDS = {"all": True, "none": False}


@dataclass(frozen=True, slots=True)
class Pins:
    degrees: Mapping[str, int] = field(default_factory=dict)  # the pinned axes, by name
    zero: int | None = None
    microbatches: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None
    # Module paths of the blocks to recompute; True: every repeated block; False: none.
    recompute: tuple[str, ...] | bool | None = None
    # The same, for the blocks whose attention core alone is recomputed (selective).
    recompute_attention: tuple[str, ...] | bool | None = None
    # A precision (`policy.Precision`), or a choice of them the solver makes
    # (`policy.PRECISION_CHOICES`: "bf16-auto", bf16-mixed or bf16-params).
    precision: str = "fp32"
    sequence_parallel: bool | None = None  # None: the solver's choice where tp > 1
    sync_every: int | None = None  # local SGD: the user's choice only (it changes the math)
    sync_warmup: int = 0
    outer_optimizer: str | None = None  # local SGD's, the user's choice only
    # The model's statistics over its batch (batch norms, a load-balancing loss) and its
    # routing over the batch's rows (capacity, expert choice) taken over each part's
    # examples: the user's choice only (it changes the math).
    per_part_statistics: bool = False
    grad_compression: str | None = None  # the user's choice only (it changes the math)
    offload: bool | None = None  # None: only where no plan fits without it
    # "host": fp32 master weights beside the offloaded state, 16-bit copies on the
    # device (it changes the math: the user's choice only). It implies offload.
    master_weights: str = "device"
    # Under precision "bf16-params" (or "bf16-auto", where the solver keeps it): the
    # dtype the data-parallel gradients are reduced in, "fp32" or "bf16" (FSDP2's
    # reduce_dtype; the user's choice only).
    reduce_dtype: str = "fp32"
    # Each rank's programs compiled by inductor (`parallelize(..., compile=True)`): the
    # plans are priced compiled (`cost_models/fusion.py`).
    compile: bool = False
    # The optimizer the plan will run, where known: ZeRO is left out unless it is exact
    # for it (policy.zero_refusal).
    optimizer_class: type[torch.optim.Optimizer] | None = None
    # The graph output leaf holding the logits of a standard cross-entropy, where known
    # (`ops.loss_match`): the runtime computes it on logits sharded over the vocabulary,
    # so a layout that shards them is priced without their gather.
    sharded_logits: int | None = None
    # Where the batch is split and the model scores it against itself (a batch × batch
    # product): "rows" where the loss is known to be a mean over the product's rows
    # (`ops.batch_products.loss_by_rows`), else "whole" (the loss gets it all).
    batch_product_loss: str = WHOLE

    @property
    def modes(self) -> tuple[str, ...]:
        """The precisions the pin allows: itself, or the modes a choice names
        (`policy.PRECISION_CHOICES`)."""
        return PRECISION_CHOICES.get(self.precision, (self.precision,))

    def in_mode(self, precision: str) -> Pins:
        """These pins with `precision` fixed (one of `modes`). Where the pin was a
        choice, the reduce dtype is 16-bit parameters' own: fp32 for the other modes."""
        if self.precision not in PRECISION_CHOICES or precision in PARAM_DTYPES:
            return replace(self, precision=precision)
        return replace(self, precision=precision, reduce_dtype=ReduceDtype.FP32.value)

    @classmethod
    def of(cls, **pins: Any) -> Pins:
        """Pins by name, as `autopart.plan(...)` takes them: axes (`dp`, `tp`, ...) and
        the other fields; None leaves a pin to the solver."""
        axes = axis_names()
        known = axes + [f.name for f in fields(cls) if f.name != "degrees"]
        unknown = sorted(set(pins) - set(known))
        if unknown:
            raise TypeError(f"unknown pins {unknown}: autopart pins {', '.join(known)}")
        recompute = pins.get("recompute")
        if recompute == "attention":  # every block's attention core, nothing else
            pins["recompute"], pins["recompute_attention"] = False, True
        elif isinstance(recompute, str):  # "all", "none", or one module path
            pins["recompute"] = RECOMPUTE_WORDS.get(recompute, (recompute,))
        attention = pins.get("recompute_attention")
        if isinstance(attention, str):  # "all", "none", or one module path
            pins["recompute_attention"] = RECOMPUTE_WORDS.get(attention, (attention,))
        # Module paths are checked against the model's blocks in make_plan, which has
        # its graph (recompute_refusal).
        schedule = pins.get("schedule")
        problem = check_choice(Schedule, schedule, "schedule") if schedule is not None else None
        if problem:
            raise PlanError(problem)
        precision = pins.get("precision")
        if precision is not None:
            pins["precision"] = PRECISION_ALIASES.get(precision, precision)
            problem = check_choice(Precision, pins["precision"], "precision")
            if problem and pins["precision"] not in PRECISION_CHOICES:
                aliases = ", ".join(f"{a!r} for {p!r}" for a, p in PRECISION_ALIASES.items())
                choices = ", ".join(map(repr, PRECISION_CHOICES))
                raise PlanError(f"{problem} (or {aliases}; or {choices}, the solver's choice)")
        problem = check_choice(ReduceDtype, pins.get("reduce_dtype", "fp32"), "reduce_dtype")
        if problem:
            raise PlanError(problem)
        host_masters = pins.get("master_weights") == MasterWeights.HOST
        if host_masters and pins.get("offload") is None:  # the host's copies: offloaded
            pins["offload"] = True
        asked = cls(**{k: v for k, v in pins.items() if k not in axes})
        on_axes = {k: v for k, v in pins.items() if k in axes and v is not None}
        refusals = {m: _mode_refusal(asked, m, on_axes) for m in asked.modes}
        if all(refusals.values()):  # one refusal, or why each mode the pin names is
            raise PlanError(_refused_modes(asked.precision, refusals))
        sync_every, compression = pins.get("sync_every"), pins.get("grad_compression")
        if sync_every is not None or compression is not None:  # whole replicas: no ZeRO
            refusal = replica_opt_in_refusal(pins.get("zero") or 0, sync_every, compression)
            if refusal:
                raise PlanError(refusal)
            pins["zero"] = 0
        refusal = outer_optimizer_refusal(pins.get("outer_optimizer"), sync_every)
        if refusal:
            raise PlanError(refusal)
        pinned = {k: pins.pop(k) for k in axes if k in pins and pins[k] is not None}
        try:
            Degrees(pinned)  # positive integers, or a clear error
        except MeshError as e:
            raise PlanError(f"pin {e}") from None
        return cls(degrees=pinned, **pins)

    def degree(self, axis: Axis | str) -> int | None:
        """The pinned degree of `axis`, or None where the solver chooses."""
        return self.degrees.get(str(axis))


def _mode_refusal(pins: Pins, precision: str, degrees: Mapping[str, int]) -> str | None:
    """Why the pins alone refuse to run in `precision` (its master weights, its
    16-bit parameters), or None; a zero left free is chosen to fit."""
    mode = pins.in_mode(precision)
    refusal = master_weights_refusal(mode.master_weights, bool(mode.offload), precision)
    return refusal or param_dtype_refusal(
        precision,
        mode.reduce_dtype,
        (degrees.get("dp") or 1) * (degrees.get("ep") or 1),
        degrees.get("cp") or 1,
        1 if mode.zero is None else mode.zero,
        bool(mode.offload),
        mode.sync_every is not None,
        mode.grad_compression is not None,
    )


def _refused_modes(precision: str, refusals: Mapping[str, str | None]) -> str:
    """The refusal of a pinned precision, or of every mode a choice allows."""
    if len(refusals) == 1:
        return next(r for r in refusals.values() if r)
    why = "; ".join(f"{mode}: {refusal}" for mode, refusal in refusals.items())
    return f"precision={precision!r} leaves the solver no mode that runs here ({why})"


# Makes the capture of a model whose parameters hold a dtype (None: as built).
Recapture = Callable[[torch.dtype | None], Captured]


def make_plan(
    captured: Captured, mesh: Mesh, pins: Pins, captured_in: Recapture | None = None
) -> Plan:
    """The plan for `captured` on `mesh`: the search's choice among what `pins` allow,
    with its tensor-parallel layout, pipeline cuts, predictions and runners-up. Where
    the precision pin leaves a choice of modes (`policy.PRECISION_CHOICES`), each mode
    is planned on the capture it runs (`captured_in` makes it: in bf16 for 16-bit
    parameters; `captured` is the model as built) and `_choose_mode` keeps one."""
    with young_collections_only():
        return _make_plan(captured, mesh, pins, captured_in)


def _make_plan(captured: Captured, mesh: Mesh, pins: Pins, captured_in: Recapture | None) -> Plan:
    if len(pins.modes) > 1:
        return _choose_mode(captured, mesh, pins, captured_in)
    batch = batch_size((captured.example_args, captured.example_kwargs))
    per_part = pins.per_part_statistics
    mixing, norms = mixing_kinds(captured.gm, statistics=not per_part)
    pins = _whole_batch(pins, mixing, mesh, norms)
    _check_pins(pins, mesh, batch)
    refusal = recompute_refusal(captured.gm, pins.recompute, pins.recompute_attention)
    if refusal:
        raise PlanError(refusal)
    dims = {k: v for k, v in captured.dim_sizes.items() if k != BATCH}
    layouts = TpLayouts(
        captured.gm, captured.parameter_names, mesh, dims, pins.precision, pins.sharded_logits
    )
    layouts.memory_priced = pins.degree(Axis.TP) is not None or memory_may_bind(
        layouts, mesh, pins, batch, dims
    )
    _check_context_pin(pins, layouts)
    _check_expert_pin(pins, layouts)
    try:
        found = search(layouts, mesh, pins, batch, dims)
    except NoPlanFits as e:
        fits = _what_fits(captured, mesh, pins, batch, dims, mixing, norms)
        raise PlanError(f"{e}{_kept_whole(mixing, norms)}{fits}") from None
    # The plan as it will run (its own stage cuts) is priced again; should it no longer
    # fit, the next plan that fits takes its place.
    for candidate in found:
        plan = _plan_of(candidate.choices, captured, mesh, pins, batch, layouts)
        summary = layouts.summary(plan.tp, plan.sequence_parallel)
        predicted = predict(summary, mesh, Choices.of(plan), dims=dims)
        if predicted.peak_memory_bytes <= mesh.device.memory_bytes:
            break
    else:
        raise PlanError(
            "no plan fits once its pipeline stages are cut: the closest needs "
            f"{format_bytes(predicted.peak_memory_bytes)} per rank; use more devices or a "
            "smaller batch"
        )
    alternatives = _alternatives(c for c in found if c is not candidate)
    models = CostModels.of(mesh, plan.precision, plan.compiled)
    collectives = resharding(summary, Choices.of(plan), models, dims)
    predicted = replace(predicted, resharding=collectives)
    return plan.with_changes(
        predicted=predicted, alternatives=alternatives, offload_reason=candidate.offload_reason
    )


def _choose_mode(captured: Captured, mesh: Mesh, pins: Pins, captured_in: Recapture | None) -> Plan:
    """The plan of the precision the solver keeps among those `pins` allow: each
    mode's own plan, where the pins let it run and a plan fits; then the first mode
    (autocast over fp32 weights, which changes the math least) unless a later mode's
    plan is faster by more than CHOICE_SLACK (the search's rule, `search.py`). The plan
    says why (`Plan.precision_reason`)."""
    plans: dict[str, Plan] = {}
    why_not: dict[str, str] = {}
    for mode in pins.modes:
        refusal = _mode_refusal(pins, mode, pins.degrees)
        if refusal:
            why_not[mode] = refusal
            continue
        dtype = PARAM_DTYPES.get(mode)
        if dtype is not None and captured_in is None:
            raise PlanError(
                f"precision={pins.precision!r} plans {mode} on the model captured in "
                f"{dtype}: plan it with autopart.plan or parallelize, which capture it"
            )
        graph = captured if dtype is None or captured_in is None else captured_in(dtype)
        try:
            plans[mode] = make_plan(graph, mesh, pins.in_mode(mode))
        except PlanError as e:
            why_not[mode] = str(e)
    if not plans:
        raise PlanError(_refused_modes(pins.precision, why_not))
    fastest = min(plans.values(), key=_step_time)
    chosen = next(p for p in plans.values() if _step_time(p) <= (1 + SLACK) * _step_time(fastest))
    return chosen.with_changes(precision_reason=_mode_reason(pins, chosen, plans, why_not))


def _step_time(plan: Plan) -> float:
    assert plan.predicted is not None  # make_plan's plans are priced
    return plan.predicted.step_time_s


def _mode_reason(
    pins: Pins, chosen: Plan, plans: Mapping[str, Plan], why_not: Mapping[str, str]
) -> str:
    """Why `chosen`'s precision, in words: each other mode's plan against it, or why
    that mode has none."""

    def figures(plan: Plan) -> str:
        assert plan.predicted is not None
        p = plan.predicted
        return (
            f"{p.step_time_s * 1e3:.2f} ms a step and {format_bytes(p.peak_memory_bytes)} "
            f"per rank (zero={plan.zero}, {plan.degrees})"
        )

    parts = [f"the {chosen.precision} plan is predicted at {figures(chosen)}"]
    first = pins.modes[0]
    for mode in pins.modes:
        if mode == chosen.precision:
            continue
        if mode in why_not:
            parts.append(f"{mode} has no plan here: {why_not[mode]}")
            continue
        plan = plans[mode]
        if mode == first:
            parts.append(
                f"the {mode} plan at {figures(plan)}, slower by more than {SLACK:.0%}, "
                f"the margin within which {first} is kept (it changes the math least)"
            )
        else:
            parts.append(
                f"the {mode} plan at {figures(plan)}, not faster by more than "
                f"{SLACK:.0%}, so {first} is kept (it changes the math least)"
            )
    return "; ".join(parts)


def _whole_batch(pins: Pins, mixing: list[str], mesh: Mesh, norms: list[str]) -> Pins:
    """`pins` with dp and microbatches fixed at 1 where the model mixes the examples of
    its batch (`mixing`, passes.batch_mixing): splitting the batch would change what it
    computes. Pins that split it are refused, saying where the model mixes them. Batch
    norms the rewrite reduces over the replicas (`norms`) fix microbatches alone."""
    if not mixing:
        return _one_microbatch(pins, norms) if norms else pins
    split = {
        "dp": pins.degree(Axis.DP) or _dp_left(pins, mesh),
        "ep": pins.degree(Axis.EP),
        "microbatches": pins.microbatches,
    }
    splitting = [f"{k}={v}" for k, v in split.items() if v is not None and v > 1]
    if splitting:
        raise PlanError(
            f"{' and '.join(splitting)} would split the batch, but the model mixes the "
            f"examples of a batch: {'; '.join(mixing)}. Each part would compute something "
            "else than one device does on the whole batch. Pin dp=1, ep=1 and "
            "microbatches=1 (tensor or pipeline parallelism), or keep the examples apart "
            "(for BatchNorm: GroupNorm or LayerNorm, or BatchNorm in eval mode, its "
            "statistics frozen; for BatchNorm, a load-balancing loss or routing over the "
            "batch's tokens (capacity, expert choice): per_part_statistics=True takes it "
            "over each part's examples, as DDP without SyncBatchNorm and Megatron-LM do, "
            "which changes the math)"
        )
    whole = {str(Axis.DP): 1, str(Axis.EP): 1}
    return replace(pins, degrees={**pins.degrees, **whole}, microbatches=1)


def _one_microbatch(pins: Pins, norms: list[str]) -> Pins:
    """`pins` with one microbatch per replica: the mixing in `norms` (batch norms,
    batch × batch products, statistics combined over the batch) is taken over the whole
    batch over the replicas, which a replica's first microbatch would need before its
    last is computed. A pin of more is refused, saying why."""
    if pins.microbatches is not None and pins.microbatches > 1:
        raise PlanError(
            f"microbatches={pins.microbatches} would split each replica's batch, but the "
            f"model mixes the examples of its whole batch: "
            f"{'; '.join(norms)}. autopart takes it over the data-parallel replicas, "
            "but a replica runs its microbatches one after another, and the first would "
            "be computed before the last is seen. Pin microbatches=1 (more replicas "
            "instead), or per_part_statistics=True normalizes each part by its own "
            "statistics, as DDP without SyncBatchNorm does, which changes the math"
        )
    return replace(pins, microbatches=1)


def _kept_whole(mixing: list[str], norms: list[str]) -> str:
    """What a refusal adds where the batch, or each replica's part of it, stays whole."""
    if mixing:
        return f"; the batch stays whole (dp=1, one microbatch): {'; '.join(mixing)}"
    if norms:
        return f"; each replica runs one microbatch: {'; '.join(norms)}"
    return ""


def _dp_left(pins: Pins, mesh: Mesh) -> int | None:
    """The dp degree the other axes leave where they are all pinned, else None."""
    others = [n for axis, n in pins.degrees.items() if axis != Axis.DP]
    if len(others) < len(axis_names()) - 1:
        return None
    return mesh.world_size // math.prod(others)


def _check_pins(pins: Pins, mesh: Mesh, batch: int) -> None:
    """Refuse pins that no plan can honour, saying which and why, before searching."""
    refusal = zero_refusal(pins.zero or 0, pins.optimizer_class)
    if refusal:
        raise PlanError(refusal)
    if pins.degree(Axis.DP) is not None:
        check_divisible(batch, pins.degrees[Axis.DP], "dp")
    _check_batch_split(pins, batch)
    pinned = Degrees(pins.degrees)
    if set(pins.degrees) == set(axis_names()):
        mesh.check_covered(pinned)
    elif mesh.world_size % pinned.world_size:
        raise PlanError(
            f"the pinned {' × '.join(f'{a}={n}' for a, n in pins.degrees.items())} = "
            f"{pinned.world_size} devices do not divide the {mesh.world_size} of "
            f"{mesh.describe()}: pin degrees whose product divides {mesh.world_size}"
        )


def _check_batch_split(pins: Pins, batch: int) -> None:
    """The pinned axes that split the batch (dp, ep) and the pinned microbatches must
    split it into equal parts together, not only each on its own."""
    split = {a: n for a, n in pins.degrees.items() if a in map(str, BATCH_AXES) and n > 1}
    if pins.microbatches and pins.microbatches > 1:
        split["microbatches"] = pins.microbatches
    parts = math.prod(split.values())
    if len(split) > 1 and batch % parts:
        pinned = " × ".join(f"{k}={n}" for k, n in split.items())
        raise PlanError(
            f"the global batch of {batch} does not split into {pinned} = {parts} equal "
            f"parts: use a batch that is a multiple of {parts}, or pin fewer parts"
        )


def recompute_refusal(
    gm: fx.GraphModule,
    recompute: Iterable[str] | bool | None,
    recompute_attention: Iterable[str] | bool | None = None,
) -> str | None:
    """Why the module paths pinned for recomputation (or a plan's) do not fit the
    analyzed model `gm`, or None: each must be one of its repeated blocks
    (`passes.blocks`), which the cost models price recomputed, or a module holding some
    (`model.layers`). Any other path would be printed as recomputed while nothing, or
    something unpriced, is."""
    blocks = _block_paths(gm)
    holders = {b.rsplit(".", k)[0] for b in blocks for k in range(b.count(".") + 1)}
    for pin, paths in (("recompute", recompute), ("recompute_attention", recompute_attention)):
        if paths is None or isinstance(paths, bool):
            continue
        unknown = [p for p in paths if p not in holders]
        if unknown:
            return _not_a_block(pin, unknown[0], blocks, holders)
    return _stateful_refusal(gm, blocks, recompute)


def _stateful_refusal(
    gm: fx.GraphModule, blocks: list[str], recompute: Iterable[str] | bool | None
) -> str | None:
    """Why a block pinned for recomputation cannot be: it updates buffers in place (a
    batch norm's running statistics in training mode), which its recomputation in
    backward would do a second time."""
    if recompute is None or recompute is False:
        return None
    paths = blocks if recompute is True else list(recompute)
    stateful = {
        info.instance
        for n in gm.graph.nodes
        if updates_running_statistics(n) and (info := BLOCK.get(n)) is not None
    }
    for block in blocks:
        if block in stateful and any(block == p or block.startswith(p + ".") for p in paths):
            return (
                f"recompute would run {block} twice, and its batch norm in training mode "
                "would update its running statistics a second time in backward: recompute "
                "other blocks, or none (the solver leaves such blocks out)"
            )
    return None


def _block_paths(gm: fx.GraphModule) -> list[str]:
    """The module paths of the model's repeated blocks, in the order they run."""
    found = {block.instance: None for n in gm.graph.nodes if (block := BLOCK.get(n))}
    return list(found)


def _not_a_block(pin: str, path: object, blocks: list[str], holders: set[str]) -> str:
    """What a recomputation pin takes, and the paths nearest the one that is wrong."""
    words = [*RECOMPUTE_WORDS, "attention"] if pin == "recompute" else [*RECOMPUTE_WORDS]
    takes = f"{pin} takes {', '.join(map(repr, words))}, or module paths of blocks"
    if not blocks:
        return f"{pin} names {path!r}, but the model has no repeated blocks: {takes}"
    nearest = difflib.get_close_matches(str(path), [*words, *sorted(holders)], n=3)
    guess = f" (nearest: {', '.join(map(repr, nearest))})" if nearest else ""
    shown = [repr(b) for b in blocks]
    examples = shown if len(shown) <= 3 else [*shown[:2], "...", shown[-1]]
    stacks = sorted({b.rpartition(".")[0] for b in blocks} - {""})
    of_stacks = f", or of what holds them ({', '.join(map(repr, stacks))})" if stacks else ""
    return (
        f"{pin} names {path!r}, which is no block of the model{guess}. {takes} "
        f"({', '.join(examples)}){of_stacks}"
    )


def _check_context_pin(pins: Pins, layouts: TpLayouts) -> None:
    """Refuse a pinned cp > 1 that cannot split the model's sequences: a model that
    attends over none would run whole on every cp rank."""
    cp = pins.degree(Axis.CP) or 1
    if cp == 1:
        return
    sequence = layouts.ring_sequence()
    if sequence is None:
        why = (
            "its attention does not call scaled_dot_product_attention, which ring "
            "attention replaces (eager attention, a matmul, a softmax and a matmul, would "
            "run on the whole sequence on every cp rank): compute attention with "
            "F.scaled_dot_product_attention (attn_implementation='sdpa' for a Hugging "
            "Face model), or pin cp=1"
            if sequence_length(layouts.gm, layouts.dims) is not None
            else "the model has no token input (an integer input of shape [batch, seq, "
            "...]) that attention reads: pin cp=1"
        )
        raise PlanError(f"cp={cp} splits sequences over context-parallel ranks, but {why}")
    if sequence % (2 * cp):
        raise PlanError(
            f"cp={cp} cuts each sequence into 2·cp = {2 * cp} chunks, but the sequence "
            f"has {sequence} tokens: pin a cp whose 2·cp divides {sequence}, or change "
            "the sequence length"
        )


def _check_expert_pin(pins: Pins, layouts: TpLayouts) -> None:
    """Refuse a pinned ep > 1 that cannot split the model's experts, or that asks for
    what expert parallelism does not combine with yet (cp)."""
    ep = pins.degree(Axis.EP) or 1
    if ep == 1:
        return
    experts = layouts.experts
    if experts is None:
        raise PlanError(
            f"ep={ep} splits routed experts over expert-parallel ranks, but the model has no "
            "expert layer autopart recognizes (grouped multiplies over weights stacked by "
            "expert, as Hugging Face's MoE models compute them): pin ep=1"
        )
    if experts % ep:
        raise PlanError(
            f"ep={ep} splits each layer's {experts} experts in equal runs: pin an ep that "
            f"divides {experts}"
        )
    tp = pins.degree(Axis.TP) or 1
    if tp > 1 and not layouts.splits_experts(
        tp, layouts.sequence_parallel(tp, pins.sequence_parallel)
    ):
        raise PlanError(
            f"ep={ep} cuts each rank's experts from tp={tp}'s slices of them, but the layout at "
            f"tp={tp} gathers an expert weight before its grouped multiply (its inner dims do "
            "not split evenly): pin tp=1, or ep=1"
        )
    cp = pins.degree(Axis.CP) or 1
    if cp > 1:
        raise PlanError(
            f"ep={ep} does not combine with cp={cp} yet: expert parallelism runs with dp, "
            "tp, pp, ZeRO and its offload, local SGD and gradient compression, and cp=1"
        )


def _plan_of(
    choices: Choices,
    captured: Captured,
    mesh: Mesh,
    pins: Pins,
    batch: int,
    layouts: TpLayouts,
) -> Plan:
    """The plan of the search's `choices`: its pipeline cuts and tensor-parallel layout."""
    pipeline = choose_pipeline(
        captured.gm,
        choices.pp,
        choices.schedule,
        choices.virtual_stages,
        choices.microbatches,
        choices.stage_cuts,
    )
    return Plan(
        mesh=MeshSpec.of(mesh),
        fingerprint=captured.fingerprint,
        global_batch=batch,
        degrees=choices.degrees,
        zero=choices.zero,
        microbatches=pipeline.microbatches,
        schedule=pipeline.schedule,
        virtual_stages=pipeline.virtual_stages,
        stage_cuts=pipeline.stage_cuts,
        precision=pins.precision,
        sequence_parallel=choices.sequence_parallel,
        sync_every=pins.sync_every,
        sync_warmup=pins.sync_warmup,
        outer_optimizer=pins.outer_optimizer,
        per_part_statistics=pins.per_part_statistics,
        batch_product_loss=_product_loss(captured, choices, pins),
        grad_compression=pins.grad_compression,
        offload=choices.offload,
        master_weights=pins.master_weights,
        reduce_dtype=pins.reduce_dtype,
        compiled=pins.compile,
        recompute=choices.recompute,
        recompute_attention=choices.recompute_attention,
        placements=_placements(captured, layouts.placements(choices.tp), choices.zero),
        tp_roles=layouts.roles(choices.tp, choices.sequence_parallel),
        ep_params=layouts.expert_params if choices.ep > 1 else (),
    )


def _product_loss(captured: Captured, choices: Choices, pins: Pins) -> str | None:
    """What the loss gets of the model's batch × batch products where the batch is split
    over replicas (`passes/batch_products.py`); None where it is whole or has none."""
    split = choices.degrees.batch_split > 1
    return pins.batch_product_loss if split and gathered_products(captured.gm) else None


def _what_fits(
    captured: Captured,
    mesh: Mesh,
    pins: Pins,
    batch: int,
    dims: dict,
    mixing: list[str],
    norms: list[str],
) -> str:
    """With every axis unpinned, the plan that would fit, as advice."""
    open_pins = _whole_batch(
        Pins(precision=pins.precision, sharded_logits=pins.sharded_logits, compile=pins.compile),
        mixing,
        mesh,
        norms,
    )
    if pins == open_pins:
        return ""
    try:
        layouts = TpLayouts(
            captured.gm, captured.parameter_names, mesh, dims, pins.precision, pins.sharded_logits
        )
        c = search(layouts, mesh, open_pins, batch, dims)[0]
    except NoPlanFits:
        return ""
    what = c.choices
    return (
        f". What fits: {what.degrees} zero={what.zero}"
        f"{' with recomputation' if what.recompute else ''} "
        f"({format_bytes(c.predicted.peak_memory_bytes)} per rank)"
    )


def _alternatives(others: Iterable[Candidate]) -> tuple[Alternative, ...]:
    """The first MAX_ALTERNATIVES of `others` (fastest first) that differ in what they
    switch on: plans that differ only in where they cut or which blocks they recompute
    are listed once, by the fastest."""
    out: dict[Alternative, Alternative] = {}
    for candidate in others:
        alternative = _alternative(candidate)
        out.setdefault(replace(alternative, step_time_s=0.0, peak_memory_bytes=0), alternative)
        if len(out) == MAX_ALTERNATIVES:
            break
    return tuple(out.values())


def _alternative(candidate: Candidate) -> Alternative:
    c, p = candidate.choices, candidate.predicted
    return Alternative(
        c.degrees,
        c.zero,
        c.microbatches,
        c.schedule,
        p.step_time_s,
        p.peak_memory_bytes,
        virtual_stages=c.virtual_stages,
        sequence_parallel=c.sequence_parallel,
        recompute=len(c.recompute),
        recompute_attention=len(c.recompute_attention),
        offload=c.offload,
    )


def _placements(
    captured: Captured, tp_places: Mapping[str, Placement], zero: int
) -> dict[str, tuple[Placement, ...]]:
    """(dp, tp) placements per parameter: ZeRO-3 shards every parameter over dp."""
    dp_place = Shard(0) if zero == 3 else Replicate()
    return {
        fqn: (dp_place, tp_places.get(fqn, Replicate()))
        for fqn, _ in captured.gm.named_parameters()
    }
