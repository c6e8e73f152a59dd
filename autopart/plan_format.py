"""Plans as text: the table `str(plan)` prints, `plan.explain()`, and `plan.diff()`."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from autopart.degrees import Axis
from autopart.mesh import PRESETS
from autopart.placements import placement_to_str
from autopart.policy import CHOICE_SLACK, PARAM_DTYPES, MasterWeights, cp_gradients_in_sync

if TYPE_CHECKING:
    from autopart.plan import Alternative, Plan, Predicted, Resharding, StageFigures


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def compact_paths(paths: tuple[str, ...]) -> list[str]:
    """Module paths with runs of numbered siblings folded: `model.layers.0-31 (32 blocks)`
    for model.layers.0, model.layers.1, ..., model.layers.31."""
    out: list[str] = []
    runs: list[tuple[str, int, int]] = []  # (parent, first, last)
    for path in paths:
        parent, _, leaf = path.rpartition(".")
        if leaf.isdigit() and runs and runs[-1][0] == parent and runs[-1][2] + 1 == int(leaf):
            runs[-1] = (parent, runs[-1][1], int(leaf))
            continue
        _flush(runs, out)
        if leaf.isdigit():
            runs.append((parent, int(leaf), int(leaf)))
        else:
            out.append(path)
    _flush(runs, out)
    return out


def _flush(runs: list[tuple[str, int, int]], out: list[str]) -> None:
    for parent, first, last in runs:
        count = last - first + 1
        out.append(
            f"{parent}.{first}" if count == 1 else f"{parent}.{first}-{last} ({count} blocks)"
        )
    runs.clear()


PLACEMENT_AXES = (Axis.DP, Axis.TP)  # the order of a parameter's placements


def _axes_line(plan: Plan) -> str:
    parts = [f"{a}={n}" for a, n in plan.degrees.items()] + [f"zero={plan.zero}"]
    if plan.sequence_parallel:
        parts.append("sequence_parallel")
    if plan.pp > 1:
        parts.append(f"schedule={plan.schedule}")
        if plan.virtual_stages > 1:
            parts.append(f"virtual_stages={plan.virtual_stages}")
    parts.append(f"microbatches={plan.microbatches}")
    return "  ".join(parts)


def format_plan(plan: Plan) -> str:
    lines = [
        f"autopart plan v{plan.version} for model {plan.fingerprint} on {plan.mesh} "
        f"({plan.mesh.world_size} devices)",
        f"  {_axes_line(plan)}",
        f"  precision={plan.precision}{' (the solver chose it)' if plan.precision_reason else ''}"
        f"{'  compiled' if plan.compiled else ''}  global batch={plan.global_batch}  "
        f"per-rank batch={plan.global_batch // plan.dp}",
    ]
    if plan.tp_shards_nothing:
        lines.append(
            f"  tp={plan.tp} shards nothing: each of its ranks runs the whole step on the "
            "same samples, with no collective between them"
        )
    if plan.recompute:
        lines.append(f"  recompute: {', '.join(compact_paths(plan.recompute))}")
    if plan.recompute_attention:
        lines.append(
            f"  recompute attention cores of: {', '.join(compact_paths(plan.recompute_attention))}"
        )
    if plan.stage_cuts:
        lines.append(f"  stages begin at: {', '.join(plan.stage_cuts)}")
    lines += [f"  {line}" for line in _opt_in_lines(plan)]
    p = plan.predicted
    if p is not None:
        lines.append(
            f"  predicted step {p.step_time_s * 1e3:.2f} ms (compute {p.compute_s * 1e3:.2f}, "
            f"exposed comm {p.exposed_comm_s * 1e3:.2f}, bubble {p.bubble_s * 1e3:.2f}); "
            f"peak memory {format_bytes(p.peak_memory_bytes)}; "
            f"{p.model_flops_per_device / 1e12:.3f} model TFLOP/s per device"
        )
        if plan.predictions_stale:
            lines.append(f"  {STALE}")
    if plan.placements:
        axes, placed = _shown_placements(plan)
        rows = _collapse_layers(placed)
        width = max(len("parameter"), *(len(name) for name, _ in rows)) + 2
        header = "parameter".ljust(width) + "".join(str(a).ljust(6) for a in axes)
        lines += ["", "  " + header, "  " + "-" * len(header)]
        for name, ps in rows:
            lines.append("  " + name.ljust(width) + "".join(p.ljust(6) for p in ps))
    if plan.alternatives:
        lines += ["", "  alternatives that fit, fastest first:"]
        lines += [f"    {alternative_line(plan, a)}" for a in plan.alternatives]
        lines.append(
            f"  chosen: the simplest plan within {CHOICE_SLACK:.0%} of the fastest "
            "(the fewest mechanisms switched on; explain() says which count)"
        )
    return "\n".join(lines)


# How the search chooses (solver/search.py `_solve`), where the alternatives are shown.
CHOICE_RULE = (
    f"the simplest plan within {CHOICE_SLACK:.0%} of the fastest that fits, by the "
    "search's prices; simplest: the fewest mechanisms switched on (axes besides dp, "
    "ZeRO, recomputation, interleaving, gradient accumulation outside a pipeline, "
    "sequence parallelism), "
    "the fastest among equally simple"
)
STALE = (
    "stale: these predictions are the plan's before it was edited (with_changes); plan "
    "again with the edit pinned to price it"
)


def _opt_in_lines(plan: Plan) -> list[str]:
    """What the plan switches on beyond its axes and ZeRO: where the optimizer state and
    the master weights live, and the opt-ins that change the math."""
    lines = []
    if plan.offload:
        why = "no plan keeping it on the device fits" if plan.offload_reason else "as pinned"
        lines.append(f"offload: the optimizer state lives and steps in host memory ({why})")
    if plan.master_weights == MasterWeights.HOST:
        low = plan.precision.split("-")[0]
        lines.append(f"master weights: fp32 on the host, {low} copies on the device")
    if plan.precision in PARAM_DTYPES:
        lines.append(
            f"parameters: bf16, fp32 masters with the optimizer; gradients reduced in "
            f"{plan.reduce_dtype}"
        )
    if plan.grad_compression is not None:
        lines.append(f"gradient compression: {plan.grad_compression} (changes the math)")
    if plan.sync_every is not None:
        warmup = f" after {plan.sync_warmup} plain steps" if plan.sync_warmup else ""
        outer = f", outer optimizer {plan.outer_optimizer}" if plan.outer_optimizer else ""
        lines.append(
            f"local SGD: parameters averaged every {plan.sync_every} steps{warmup}{outer} "
            "(changes the math)"
        )
    if plan.per_part_statistics:
        lines.append("per-part statistics: over each part's examples (changes the math)")
    return lines


def _batch_product_lines(plan: Plan) -> list[str]:
    """What the loss gets of a batch × batch product under a split of the batch."""
    if plan.batch_product_loss is None:
        return []
    if plan.batch_product_loss == "rows":
        return [
            "The model scores its batch against itself (a batch × batch product), and the "
            "loss is a mean over the product's rows: each replica gathers the other side's "
            "embeddings (the columns) over the replicas, their gradients flowing back to "
            "their owners, scores its own rows against every column, and the loss runs on "
            "its rows, their mean over the replicas one device's."
        ]
    return [
        "The model scores its batch against itself (a batch × batch product), and the loss "
        "is not a mean over the product's rows: each replica gathers both sides' "
        "embeddings over the replicas, their gradients flowing back to their owners, "
        "computes the whole product, and the loss runs on the whole product and the whole "
        "target on every replica, as on one device."
    ]


def alternative_label(a: Alternative) -> str:
    """What an alternative switches on, in the words of `str(plan)`."""
    parts = [str(a.degrees), f"zero={a.zero}", f"m={a.microbatches}"]
    parts += [a.schedule] if a.schedule else []
    parts += [f"v={a.virtual_stages}"] if a.virtual_stages > 1 else []
    parts += ["sequence_parallel"] if a.sequence_parallel else []
    parts += [f"recompute {_count(a.recompute, 'block')}"] if a.recompute else []
    if a.recompute_attention:
        parts.append(f"recompute {_count(a.recompute_attention, 'attention core')}")
    parts += ["offload"] if a.offload else []
    parts += [a.note] if a.note else []
    return " ".join(parts)


def alternative_gap(plan: Plan, a: Alternative) -> str:
    """An alternative's step time and peak memory against the plan's:
    `+3.4% step time, -20.0% memory`."""
    p = plan.predicted
    if p is None or p.step_time_s <= 0 or p.peak_memory_bytes <= 0:
        return ""
    time = a.step_time_s / p.step_time_s - 1
    memory = a.peak_memory_bytes / p.peak_memory_bytes - 1
    return f"{_percent(time)} step time, {_percent(memory)} memory"


def _percent(x: float) -> str:
    # Rounded first, so that a gap too small to show reads +0.0%, not -0.0%.
    return f"{round(x, 3) + 0.0:+.1%}"


def alternative_line(plan: Plan, a: Alternative) -> str:
    gap = alternative_gap(plan, a)
    return (
        f"{alternative_label(a)}: {a.step_time_s * 1e3:.2f} ms, "
        f"{format_bytes(a.peak_memory_bytes)}{f' ({gap})' if gap else ''}"
    )


def _folded(names: list[str]) -> str:
    """Parameter names with repeated layers folded: `layers.*.mlp.up.weight (×32)`."""
    patterns = Counter(re.sub(r"\.\d+\.", ".*.", n) for n in names)
    return ", ".join(p if n == 1 else f"{p} (×{n})" for p, n in patterns.items())


def _shown_placements(plan: Plan) -> tuple[tuple[Axis, ...], dict[str, tuple[str, ...]]]:
    """The axes a parameter's placements are shown on, and each parameter's, as text:
    the plan's (dp, tp), with ep between them where ep > 1. ep splits the stacked
    expert weights on dim 0 (`Plan.ep_params`); the other weights are whole on every ep
    rank, but for ZeRO-3's shards, which span dp × ep."""
    shown = {fqn: tuple(placement_to_str(p) for p in ps) for fqn, ps in plan.placements.items()}
    if plan.ep == 1:
        return PLACEMENT_AXES, shown
    experts = set(plan.ep_params)
    other = "S(0)" if plan.zero == 3 else "R"
    return (Axis.DP, Axis.EP, Axis.TP), {
        fqn: (dp, "S(0)" if fqn in experts else other, tp) for fqn, (dp, tp) in shown.items()
    }


def _collapse_layers(placed: dict[str, tuple[str, ...]]) -> list[tuple[str, tuple[str, ...]]]:
    """One row per parameter, with repeated layers folded: `layers.*.mlp.w (×32)` stands
    for every layer whose copy of the parameter is placed alike."""
    groups: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for fqn, names in placed.items():
        pattern = re.sub(r"\.\d+\.", ".*.", fqn)
        groups.setdefault((pattern, names), []).append(fqn)
    rows: list[tuple[str, tuple[str, ...]]] = []
    for (pattern, names), members in groups.items():
        rows.append((members[0] if len(members) == 1 else f"{pattern} (×{len(members)})", names))
    return rows


def _sixteen_bit_parameters(plan: Plan) -> str:
    """How "bf16-params" differs from autocast, in what it holds, moves and computes."""
    held = "each rank's shard of them" if plan.zero else "one whole copy"
    after_step = "The updated shards are gathered in bf16 after the step, half autocast's bytes. "
    gathered = {
        3: "ZeRO-3 gathers the bf16 copies, 2 bytes a parameter, where autocast's fp32 "
        "shards move 4. ",
        1: after_step,
        2: after_step,
    }.get(plan.zero, "")
    why = "As chosen (see above)" if plan.precision_reason else "As asked (precision='bf16-params')"
    return (
        f"{why}, the model itself computes in bf16, as FSDP2's "
        "param_dtype and Megatron-LM's --bf16 run it: its graph was captured over bf16 "
        f"parameters and inputs, and the fp32 master weights live with the optimizer "
        f"({held}), which refreshes the bf16 copies once after each step instead of "
        f"autocast's cast at every use. {gathered}"
        f"Gradients are reduced in {plan.reduce_dtype}{_sixteen_bit_accumulation(plan)}. "
        "The predictions price that: "
        "2 bytes a weight held for compute, 12 for the masters and Adam's moments, 4 for "
        "the gradients the optimizer reads, and the graph's own bf16 bytes moved, with no "
        "casts. This changes the math from fp32 (and from autocast): every operator, "
        "norms and elementwise ones included, reads bf16 weights and activations."
    )


def _sixteen_bit_accumulation(plan: Plan) -> str:
    """Where 16-bit parameters sum microbatches' gradients in bf16 (their `.grad`, which
    holds the parameter's dtype) before widening them: ZeRO-0/1's whole gradients. FSDP2
    accumulates in its reduce dtype; ZeRO-2/3 reduce each microbatch, into fp32."""
    if plan.microbatches == 1 or plan.zero >= 2:
        return ""
    return (
        f", after each rank sums its {plan.microbatches} microbatches' gradients in bf16 "
        "(the parameters' own dtype; FSDP2 sums them in fp32: zero=2 or 3 would too)"
    )


def explain_plan(plan: Plan) -> str:
    axes, placed = _shown_placements(plan)
    counts = Counter(placed.values())
    layout = ", ".join(
        f"{n} parameters {'/'.join(f'{a}:{x}' for a, x in zip(axes, k))}"
        for k, n in counts.most_common()
    )
    lines = [
        f"The {plan.mesh.world_size} devices of {plan.mesh} are split as {_axes_line(plan)}.",
        f"Each data-parallel rank takes {plan.global_batch // plan.degrees.batch_split} of "
        f"the {plan.global_batch} samples per step"
        + (f", in {plan.microbatches} microbatches." if plan.microbatches > 1 else "."),
    ]
    if layout:
        lines.append(f"Parameter layout: {layout}.")
    lines += _tensor_parallel_lines(plan)
    if plan.cp > 1:
        lines.append(
            f"Context parallelism splits every sequence over the {plan.cp} cp ranks: each "
            f"holds 2 of its {2 * plan.cp} chunks, the i-th and the i-th from the end, so "
            "that causal attention's work is even. Attention runs as a ring that passes "
            "keys and values from rank to rank where it is scaled_dot_product_attention, "
            "causal or unmasked and without dropout; other attention, and what cannot run "
            "on a rank's chunks (routed expert layers), gathers the whole sequence first "
            "and runs whole on every cp rank (priced so). Each weight's gradient is summed "
            "over the cp ranks"
            + (
                " by the data-parallel sync, once per step"
                if cp_gradients_in_sync(plan.zero, plan.sync_every, plan.grad_compression)
                else " in backward, as it is produced"
            )
            + ", and the logits are gathered whole for the loss."
        )
    if plan.ep > 1:
        lines.append(
            f"Expert parallelism splits each routed layer's experts over the {plan.ep} ep "
            "ranks, which also split the batch as data-parallel ranks do: each routes its "
            "own tokens, and every (token, expert) row travels to its expert's rank and "
            "back with an all_to_all, none dropped. The experts' gradients are summed over "
            f"their {plan.dp} dp replicas, the other weights' over all {plan.dp * plan.ep} "
            "ranks."
        )
    lines += _batch_product_lines(plan)
    if plan.zero:
        what = {
            1: "optimizer state",
            2: "optimizer state and gradients",
            3: "optimizer state, gradients and parameters",
        }[plan.zero]
        over = (
            f"the {plan.degrees.batch_split} dp × ep ranks (each expert's over its "
            f"{plan.dp} dp replicas)"
            if plan.ep > 1
            else f"the {plan.dp} dp ranks"
        )
        lines.append(f"ZeRO-{plan.zero} shards the {what} over {over}.")
    if plan.offload:
        held = "shard of the optimizer state" if plan.degrees.batch_split > 1 else "optimizer state"
        why = (
            "chosen because no plan keeping the optimizer state on the device fits its "
            f"memory: the smallest {plan.offload_reason}"
            if plan.offload_reason
            else "as pinned (autopart offloads only where no plan keeping the state on "
            "the device fits)"
        )
        lines.append(
            f"ZeRO offload, {why}. Each rank's {held} lives in host memory and the "
            "optimizer steps there: the gradients go down the host link while backward "
            "goes on (ZeRO-3's once it is over), and an elementwise optimizer steps the "
            "state tile by tile, each tile's updated parameters going back up while it "
            "steps the next."
        )
    if plan.precision_reason:
        lines.append(
            f"Precision {plan.precision}, the solver's choice among the modes the precision "
            f"pin allowed: {plan.precision_reason}."
        )
    if plan.precision in PARAM_DTYPES:
        lines.append(_sixteen_bit_parameters(plan))
    lines += _compiled_lines(plan)
    if plan.master_weights == MasterWeights.HOST:
        low = plan.precision.split("-")[0]
        lines.append(
            f"As asked (master_weights='host'), the fp32 master weights live on the host "
            f"beside the optimizer state, and the device holds {low} copies of them: half "
            f"the bytes for weights and gradients, and half over the host link. Contractions "
            f"read the copies as autocast would have cast the fp32 weights; every other "
            f"operator reads them widened. This changes the math: those operators read "
            f"{low}-rounded weights, and the gradients are accumulated and reduced in {low}."
        )
    lines += _local_sgd_lines(plan)
    parts = plan.degrees.batch_split * plan.microbatches
    if plan.per_part_statistics and parts > 1:
        lines.append(
            "As asked (per_part_statistics=True), each of the batch's "
            f"{parts} parts takes the model's statistics over the batch over its own "
            "examples, if any: its batch norms' means and variances, as DDP without "
            "SyncBatchNorm does (each forward starts from the first replica's running "
            "statistics, as DDP's broadcast of buffers does); a load-balancing loss's "
            "token fractions and router probabilities, and its routing over the batch's "
            "tokens (an expert's capacity, expert choice), as Megatron-LM does. This "
            "changes the math: one device takes them over the whole batch."
        )
    if plan.grad_compression is not None and plan.degrees.batch_split > 1:
        who = (
            f"the {plan.dp * plan.ep} ranks of dp × ep all-reduce the other weights' "
            "gradients" + (f", and the experts' {plan.dp} replicas theirs," if plan.dp > 1 else "")
            if plan.ep > 1
            else f"the {plan.dp} data-parallel replicas all-reduce their gradients"
        )
        lines.append(
            f"Gradient compression, as asked ({plan.grad_compression}): {who} "
            + COMPRESSION_WHAT[plan.grad_compression.split(":")[0]]
            + ". This changes the math: results differ from one device beyond rounding."
        )
    lines += _stage_lines(plan)
    lines.append(_reduction_order(plan))
    if plan.predicted is not None:
        p = plan.predicted
        lines.append(
            f"Predicted step time {p.step_time_s * 1e3:.2f} ms; peak memory "
            f"{format_bytes(p.peak_memory_bytes)} per rank ("
            + ", ".join(f"{k} {format_bytes(v)}" for k, v in p.memory.items())
            + ")."
        )
        if plan.predictions_stale:
            lines.append(STALE[0].upper() + STALE[1:] + ".")
    return "\n".join([*lines, *_choice_lines(plan)])


def _compiled_lines(plan: Plan) -> list[str]:
    """How the programs run (eager, or compiled by inductor) and how they were priced,
    where either is compiled or the two differ (`cost_models/fusion.py`)."""
    priced = plan.predicted.compiled if plan.predicted is not None else plan.compiled
    lines = []
    if plan.compiled:
        lines.append(
            "Each rank's programs run compiled by inductor (compile=True): each run of "
            "elementwise operators and normalizations between two contractions is one fused "
            "kernel that reads what flows into it and writes what leaves it once, and "
            "backward keeps what those kernels read or write rather than every "
            "intermediate; contractions, collectives and the optimizer step run as eager."
        )
    elif plan.mesh.device in PRESETS and PRESETS[plan.mesh.device].sm_count:
        lines.append(
            f"The programs run eager, priced on the {plan.mesh.device} data-sheet preset: "
            "each operator is its own kernel, its launch hidden behind the kernels queued "
            "before it. autopart's eager runtime also dispatches every operator from "
            "Python, which the preset does not price: an eager step can take longer than "
            "predicted (docs/benchmarks.md, one GPU). compile=True fuses the elementwise "
            "operators and is priced so; a profile from `autopart calibrate` measures the "
            "dispatch."
        )
    if priced != plan.compiled:
        mode = {True: "compiled by inductor", False: "eager"}
        lines.append(
            f"The predictions price the programs {mode[priced]}, as the plan was made, but "
            f"they run {mode[plan.compiled]}: plan again with compile={plan.compiled} to "
            "price what runs."
        )
    return lines


def _choice_lines(plan: Plan) -> list[str]:
    """The rule the plan was chosen by, and how the fastest plan it left compares."""
    if not plan.alternatives:
        return []
    fastest = min(plan.alternatives, key=lambda a: a.step_time_s)
    gap = alternative_gap(plan, fastest)
    return [
        f"Chosen as {CHOICE_RULE}. The fastest of the "
        f"{_count(len(plan.alternatives), 'alternative')} listed with the plan, "
        f"{alternative_label(fastest)}, is predicted at "
        f"{fastest.step_time_s * 1e3:.2f} ms and {format_bytes(fastest.peak_memory_bytes)}"
        + (f" ({gap})." if gap else ".")
    ]


def _tensor_parallel_lines(plan: Plan) -> list[str]:
    """What tensor parallelism shards, as what, and what its collectives cost."""
    if plan.tp == 1:
        return []
    tp_axis = PLACEMENT_AXES.index(Axis.TP)
    sharded = [f for f, ps in plan.placements.items() if placement_to_str(ps[tp_axis]) != "R"]
    line = (
        f"Tensor parallelism shards {len(sharded)} of {len(plan.placements)} parameter "
        f"tensors over the {plan.tp} tp ranks, the rest replicated"
    )
    by_role: dict[str, list[str]] = {}
    for fqn in sharded:
        by_role.setdefault(plan.tp_roles.get(fqn, "sharded"), []).append(fqn)
    roles = "; ".join(f"{role}: {_folded(names)}" for role, names in by_role.items())
    line += f" ({roles})." if roles else "."
    predicted = plan.predicted
    if predicted is not None and predicted.stages:
        slowest = max(predicted.stages, key=lambda s: s.tp_comm_s)
        line += (
            " Its collectives (reductions of row-parallel products, conversions between "
            f"layouts and their gradients) take {slowest.tp_comm_s * 1e3:.2f} ms per step on "
            f"the busiest rank ({slowest.tp_comm_s / predicted.step_time_s:.0%} of the step)."
        )
    return [line, *_resharding_lines(predicted.resharding if predicted else ())]


# Resharding sites listed by name in `explain()`; the rest are summed in one line.
RESHARDING_LISTED = 8


def _resharding_lines(sites: tuple[Resharding, ...]) -> list[str]:
    """Where the layout reshards, costliest first: each operator's collectives over
    every copy of its block, per step."""
    if not sites:
        return []
    lines = ["Where it reshards, per step over all stages (costliest first):"]
    for r in sites[:RESHARDING_LISTED]:
        lines.append(
            f"  {r.collective.replace('_', '-')} ({'backward' if r.backward else 'forward'}) "
            f"for {r.operator} at {r.where}: {r.count} × {format_bytes(r.bytes_each)}, "
            f"{r.seconds * 1e3:.2f} ms"
        )
    rest = sites[RESHARDING_LISTED:]
    if rest:
        lines.append(
            f"  and {_count(len(rest), 'more site')}: "
            f"{sum(r.seconds for r in rest) * 1e3:.2f} ms together"
        )
    return lines


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}{'' if n == 1 else 's'}"


def _stage_lines(plan: Plan) -> list[str]:
    """Why each pipeline stage holds its blocks, and what recomputation buys where."""
    predicted = plan.predicted
    if predicted is None or not predicted.stages:
        return []
    stages, lines = predicted.stages, []
    if plan.pp > 1:
        slowest = max(s.microbatch_s for s in stages)
        last = (plan.pp * plan.virtual_stages - 1) % plan.pp
        lines.append(
            f"The stage cuts ({', '.join(plan.stage_cuts) or 'none given'}) make the "
            f"slowest stage's time per microbatch, {slowest * 1e3:.2f} ms, as small as it "
            "can be with every stage within the device's memory; a stage that holds more "
            "microbatches in flight may take fewer blocks, or recompute some:"
        )
        for r, s in enumerate(stages):
            also = (" and the embedding before the first" if r == 0 else "") + (
                " and the head after the last" if r == last else ""
            )
            lines.append(
                f"  stage {r}: {_count(s.blocks, 'block')}{also}, "
                f"{s.microbatch_s * 1e3:.2f} ms per microbatch "
                f"({s.microbatch_s / slowest:.0%} of the slowest), "
                f"{format_bytes(s.peak_memory_bytes)} with {s.in_flight:g} "
                f"microbatch{'' if s.in_flight == 1 else 'es'} in flight"
                + (f", {_count(s.recomputed, 'block')} recomputed" if s.recomputed else "")
                + (
                    f", {_count(s.attention_recomputed, 'attention core')} recomputed"
                    if s.attention_recomputed
                    else ""
                )
            )
    recomputing = [(r, s) for r, s in enumerate(stages) if s.recomputed or s.attention_recomputed]
    if recomputing:
        effects = "; ".join(
            (f"stage {r}: " if plan.pp > 1 else "")
            + _recomputed_what(s)
            + f" free{'s' if s.recomputed + s.attention_recomputed == 1 else ''} "
            f"{format_bytes(s.recompute_frees_bytes)} of "
            f"activations for {s.recompute_s * 1e3:.2f} ms more per step"
            for r, s in recomputing
        )
        what = []
        if plan.recompute:
            blocks = ", ".join(compact_paths(plan.recompute))
            what.append(f"whole blocks (each keeps only its input): {blocks}")
        if plan.recompute_attention:
            what.append(
                "the attention core alone (scores to weighted values; the block keeps q, k "
                f"and v): {', '.join(compact_paths(plan.recompute_attention))}"
            )
        lines.append(f"Recomputed in backward: {'; '.join(what)}. {effects}.")
    return lines


def _recomputed_what(s: StageFigures) -> str:
    parts = [
        _count(n, what)
        for n, what in ((s.recomputed, "block"), (s.attention_recomputed, "attention core"))
        if n
    ]
    return " and ".join(parts)


# Unit roundoff u of each dtype a sum runs in (half the gap between 1 and the next
# number): 2^-p for p bits of significand.
_ROUNDOFF = {"fp32": 2.0**-24, "bf16": 2.0**-8, "fp16": 2.0**-11}
_COMPUTE = {"fp32": "fp32", "bf16-mixed": "bf16", "fp16-mixed": "fp16", "bf16-params": "bf16"}
# Rounding to nearest errs by up to half a unit in the last place, evenly; over the
# values of a binade (log-uniform) that is u·√(1/(8 ln 2)) ≈ 0.42 u of the value, rms.
ROUNDING_RMS = math.sqrt(1 / (8 * math.log(2)))
# A matmul accumulates in fp32 in blocks whose order follows its shape, so a part of a
# batch's product and the whole batch's differ by a few of fp32's units however the
# parts are then summed.
ACCUMULATION_UNITS = 4


def reordering_difference(dtype: str, parts: int) -> float:
    """How far a sum of `parts` partial results in `dtype`, added one after another,
    lies from the same sum computed whole on one device: the norm of the difference
    relative to the sum's. Each of the parts - 1 additions rounds a partial sum that
    grows as √k, by ROUNDING_RMS·u of it: relative to the whole, √(parts/2) roundings;
    the rounding of each part and of one device's result add about 3 more. fp32's
    accumulation inside the matmuls (`ACCUMULATION_UNITS`) is the least difference.
    tests/test_plan.py measures it on the CPU against this."""
    rounded = ROUNDING_RMS * _ROUNDOFF[dtype] * math.sqrt(parts / 2 + 3)
    return math.hypot(rounded, ACCUMULATION_UNITS * _ROUNDOFF["fp32"])


COMPRESSION_WHAT = {
    "bf16": "in bfloat16 (half the bytes of fp32, 8 bits of mantissa)",
    "powersgd": "as PowerSGD's low-rank factors, with error feedback",
}


def _local_sgd_lines(plan: Plan) -> list[str]:
    if plan.sync_every is None or plan.dp == 1:
        return []
    start = (
        f"after {plan.sync_warmup} steps of plain data parallelism, " if plan.sync_warmup else ""
    )
    replicas = (
        f"replicas (each an ep group of {plan.ep} ranks, which average the other weights' "
        "gradients every step)"
        if plan.ep > 1
        else "replicas"
    )
    return [
        f"Local SGD, as asked (sync_every={plan.sync_every}): {start}the {plan.dp} "
        f"data-parallel {replicas} step on their own gradients and average their parameters "
        f"every {plan.sync_every} steps. This changes the math (only sync_every=1 with SGD "
        "matches one device); the predicted step time prices the steady state, one "
        f"all-reduce of the parameters every {plan.sync_every} steps."
        + (
            f" The outer optimizer ({plan.outer_optimizer}) steps the parameters held "
            "since the last averaging by their difference from the replicas' mean, and "
            "every replica goes on from there (DiLoCo's outer step); it keeps "
            "a copy of the parameters (two with momentum)."
            if plan.outer_optimizer
            else ""
        )
    ]


def _reduction_order(plan: Plan) -> str:
    """Which sums the plan runs in another order than one device, and the size of the
    difference that makes (`reordering_difference`)."""
    sums = _reordered_sums(plan)
    if not sums:
        return "Every sum runs in the order it runs on one device."
    described = "; ".join(
        f"{what} ({dtype}: about {reordering_difference(dtype, parts):.0e})"
        for what, dtype, parts in sums
    )
    low = {dtype for _, dtype, _ in sums} - {"fp32"}
    own = "".join(
        f"; a {dtype} result is itself rounded by up to {_ROUNDOFF[dtype]:.0e}" for dtype in low
    )
    return (
        f"Sums in another order than on one device: {described}. Each differs from one "
        "device's by rounding, by about the figure given relative to its size (the norm "
        f"of the difference over the sum's){own}. The differences accumulate slowly over "
        "steps (autopart's tests hold fp32 losses and parameters within 1e-5 of one "
        "device over 5 AdamW steps)."
    )


def _reordered_sums(plan: Plan) -> list[tuple[str, str, int]]:
    """(what is summed, the dtype it is summed in, how many parts) for each sum the plan
    orders otherwise than one device. Gradients are fp32 (fp32 master weights) but for
    master weights on the host, whose device copies' gradients are 16-bit; a row-parallel
    product's partial sums are in the compute dtype."""
    compute = _COMPUTE[plan.precision]
    gradients = compute if plan.master_weights == MasterWeights.HOST else "fp32"
    sums = []
    if plan.dp > 1 and plan.sync_every is not None:
        sums.append((f"parameters over the {plan.dp} data-parallel ranks", "fp32", plan.dp))
    parts = (plan.dp if plan.sync_every is None else 1) * plan.microbatches
    if parts > 1:
        over = " × ".join(
            [f"the {plan.dp} data-parallel ranks"] * (plan.sync_every is None and plan.dp > 1)
            + [f"{plan.microbatches} microbatches"] * (plan.microbatches > 1)
        )
        sums.append((f"gradients over {over}", gradients, parts))
    if plan.tp > 1:
        sums.append((f"row-parallel products over the {plan.tp} tp ranks", compute, plan.tp))
    if plan.cp > 1:
        sums.append(
            (
                f"weight gradients over the {plan.cp} cp ranks, and attention's softmax over "
                f"their {2 * plan.cp} chunks of keys",
                "fp32",
                2 * plan.cp,
            )
        )
    return sums


def diff_plans(a: Plan, b: Plan) -> list[str]:
    """One short line per difference: `name: a -> b`, a parameter's placements as
    `str(plan)` shows them (repeated layers folded), the predictions by their figures."""
    out = []
    for f in fields(a):
        va, vb = getattr(a, f.name), getattr(b, f.name)
        if va != vb:
            out += _DIFFS.get(f.name, _diff_value)(f.name, va, vb)
    return out


def _diff_value(name: str, a: Any, b: Any) -> list[str]:
    return [f"{name}: {_shown(a)} -> {_shown(b)}"]


def _shown(value: Any) -> str:
    if isinstance(value, tuple) and all(isinstance(v, str) for v in value):
        return ", ".join(compact_paths(value)) or "none"
    return str(value)


def _diff_degrees(name: str, a: Any, b: Any) -> list[str]:
    return [f"{axis}: {a[axis]} -> {b[axis]}" for axis in a.names if a[axis] != b[axis]]


def _diff_per_parameter(name: str, a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """`name[parameter]: a -> b`, one line for the copies of a repeated layer alike."""
    changed: dict[tuple[str, str, str], int] = {}
    for fqn in sorted(set(a) | set(b), key=lambda n: (re.sub(r"\.\d+\.", ".*.", n), n)):
        va, vb = _per_parameter(a.get(fqn)), _per_parameter(b.get(fqn))
        if va != vb:
            key = (re.sub(r"\.\d+\.", ".*.", fqn), va, vb)
            changed[key] = changed.get(key, 0) + 1
    return [
        f"{name}[{pattern}{f' (×{n})' if n > 1 else ''}]: {va} -> {vb}"
        for (pattern, va, vb), n in changed.items()
    ]


def _per_parameter(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, tuple):
        return " ".join(placement_to_str(p) for p in value)
    return str(value)


def _diff_predicted(name: str, a: Predicted | None, b: Predicted | None) -> list[str]:
    if a is None or b is None:
        return [f"{name}: {_predicted_figures(a)} -> {_predicted_figures(b)}"]
    out = []
    if a.step_time_s != b.step_time_s:
        out.append(f"predicted step: {a.step_time_s * 1e3:.2f} -> {b.step_time_s * 1e3:.2f} ms")
    if a.peak_memory_bytes != b.peak_memory_bytes:
        out.append(
            f"predicted peak memory: {format_bytes(a.peak_memory_bytes)} -> "
            f"{format_bytes(b.peak_memory_bytes)}"
        )
    return out or [f"{name}: other figures, the same step time and peak memory"]


def _predicted_figures(p: Predicted | None) -> str:
    if p is None:
        return "none"
    return f"step {p.step_time_s * 1e3:.2f} ms, peak {format_bytes(p.peak_memory_bytes)}"


def _diff_alternatives(name: str, a: tuple, b: tuple) -> list[str]:
    def listed(alternatives: tuple) -> str:
        return "; ".join(alternative_label(x) for x in alternatives) or "none"

    return [f"{name}: {listed(a)} -> {listed(b)}"]


def _diff_stale(name: str, a: bool, b: bool) -> list[str]:
    words = {False: "current", True: "stale (made before an edit)"}
    return [f"predictions: {words[a]} -> {words[b]}"]


_DIFFS: dict[str, Callable[[str, Any, Any], list[str]]] = {
    "degrees": _diff_degrees,
    "placements": _diff_per_parameter,
    "tp_roles": _diff_per_parameter,
    "predicted": _diff_predicted,
    "alternatives": _diff_alternatives,
    "predictions_stale": _diff_stale,
}
