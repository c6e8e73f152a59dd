"""The report's figures, drawn with matplotlib's Agg canvas into PNG bytes.

Each figure is a `matplotlib.figure.Figure` attached to a `FigureCanvasAgg` directly,
not made through pyplot: pyplot keeps global figures and a global backend, and a
report written from a notebook or a GUI program must leave both alone. This module
imports matplotlib at the top; `report.html` imports it only when a page is written, so
the rest of autopart (and `autopart report` without `--html`) never needs matplotlib.
"""

from __future__ import annotations

import io
import textwrap
from collections.abc import Mapping, Sequence

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from autopart.plan import Plan, Predicted
from autopart.plan_format import alternative_label, format_bytes
from autopart.report.collectives import Collective, recorded_rank
from autopart.report.schedule import BACKWARD, FORWARD, IDLE, RECOMPUTE, Slot, idle_fraction

DPI = 100
COLOURS = {FORWARD: "#3b6fb6", BACKWARD: "#e07b39", RECOMPUTE: "#4aa564", IDLE: "#d9d9d9"}
PART_COLOURS = {
    "parameters": "#3b6fb6",
    "gradients": "#e07b39",
    "optimizer": "#8c62aa",
    "activations": "#4aa564",
    "output_gradients": "#c9404a",
    "buffers": "#8c8c8c",
    "allocator": "#c8b560",
}
TOTAL_ONLY = "#b0b0b0"
# Neither is a colour of the parts, the slots or another marker: a limit line or the
# chosen plan's star never reads as a part of memory.
LIMIT_COLOUR = "#111111"
CHOSEN_COLOUR = "#d4a017"
OFF_SCALE = 4.0  # a device limit this many times the largest bar is noted, not drawn
LABELLED_SLOTS = 200  # more operations than this per figure: no microbatch numbers


def new_figure(width_px: int, height_px: int) -> Figure:
    """A figure of this size in pixels on an Agg canvas (no pyplot state)."""
    fig = Figure(figsize=(width_px / DPI, height_px / DPI), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def png_bytes(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def _byte_scale(largest: float) -> tuple[float, str]:
    """A unit for an axis of bytes whose largest value is `largest`."""
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if largest >= size:
            return size, unit
    return 1, "bytes"


# ---------------------------------------------------------------------------------------
# The pipeline timeline


def draw_timeline(fig: Figure, timeline: list[list[Slot]], title: str) -> None:
    """Per rank, a row of its slots coloured by kind, with microbatch numbers where
    they fit."""
    ax = fig.add_subplot()
    step = max((rank[-1].end for rank in timeline if rank), default=0.0)
    scale, unit = (1e3, "ms") if step < 1 else (1.0, "s")
    labelled = sum(len(rank) for rank in timeline) <= LABELLED_SLOTS
    chunked = _chunked(timeline)
    for r, rank in enumerate(timeline):
        for kind, colour in COLOURS.items():  # one call per rank and kind: fast at any m
            bars = [(s.start * scale, (s.end - s.start) * scale) for s in rank if s.kind == kind]
            ax.broken_barh(bars, (r - 0.4, 0.8), facecolors=colour)
        for slot in rank if labelled else []:
            width = (slot.end - slot.start) * scale
            if slot.kind != IDLE and width > step * scale / 60:
                _label_slot(ax, slot, (slot.start * scale + width / 2), r, chunked)
    ax.set_yticks(range(len(timeline)), [f"rank {r}" for r in range(len(timeline))])
    ax.invert_yaxis()
    ax.set_xlim(0, step * scale or 1)
    ax.set_xlabel(f"time in the step ({unit})")
    ax.set_title(f"{title}; simulated bubble {idle_fraction(timeline):.1%} of rank time")
    handles = [Patch(color=COLOURS[k], label=k) for k in COLOURS]
    fig.legend(handles=handles, loc="outside upper right", ncols=len(handles), fontsize="small")


def _chunked(timeline: list[list[Slot]]) -> bool:
    return any(s.chunk >= len(timeline) for rank in timeline for s in rank)


def _label_slot(ax: Axes, slot: Slot, x: float, y: float, chunked: bool) -> None:
    text = f"{slot.microbatch}" + (f"·c{slot.chunk}" if chunked else "")
    ax.text(x, y, text, ha="center", va="center", fontsize=7, color="white")


# ---------------------------------------------------------------------------------------
# Memory per rank


def draw_memory(fig: Figure, predicted: Predicted, limit: int | None) -> None:
    """Stacked parts for the rank whose breakdown the plan records, totals for the
    others, against the device's memory."""
    ax = fig.add_subplot()
    totals = [s.peak_memory_bytes for s in predicted.stages] or [predicted.peak_memory_bytes]
    recorded = recorded_rank(predicted) if predicted.stages else 0
    largest = max(totals)
    drawn_limit = limit is not None and limit <= OFF_SCALE * largest
    size, unit = _byte_scale(max(largest, limit or 0) if drawn_limit else largest)
    for r, total in enumerate(totals):
        if r == recorded and predicted.memory:
            _stacked_bar(ax, r, predicted.memory, size)
        else:
            ax.bar(r, total / size, color=TOTAL_ONLY, hatch="//", edgecolor="white")
    ax.set_xticks(range(len(totals)), [f"rank {r}" for r in range(len(totals))])
    ax.set_ylabel(f"peak memory ({unit})")
    title = "memory per pipeline rank (grey hatched: total only, the plan keeps one breakdown)"
    handles = [Patch(color=PART_COLOURS[p], label=p) for p, n in predicted.memory.items() if n]
    if limit is not None and drawn_limit:
        ax.axhline(limit / size, color=LIMIT_COLOUR, linestyle="--")
        handles.append(Patch(color=LIMIT_COLOUR, label=f"device limit {format_bytes(limit)}"))
    elif limit is not None:
        title += (
            f"\ndevice limit {format_bytes(limit)}, off the scale: "
            f"the largest rank uses {100 * largest / limit:.2g}% of it"
        )
    ax.set_title(title)
    fig.legend(handles=handles, loc="outside right upper", fontsize="small")


def _stacked_bar(ax: Axes, x: int, parts: Mapping[str, int], size: float) -> None:
    bottom = 0.0
    for part, nbytes in parts.items():
        if nbytes:
            colour = PART_COLOURS.get(part, TOTAL_ONLY)
            ax.bar(x, nbytes / size, bottom=bottom, color=colour, label=part)
            bottom += nbytes / size


# ---------------------------------------------------------------------------------------
# Layers per stage


def draw_layers(fig: Figure, predicted: Predicted) -> None:
    """Blocks per pipeline rank, the recomputed ones apart."""
    ax = fig.add_subplot()
    stages = predicted.stages
    kept = [s.blocks - s.recomputed for s in stages]
    recomputed = [s.recomputed for s in stages]
    ranks = range(len(stages))
    ax.bar(ranks, kept, color=COLOURS[FORWARD], label="blocks kept")
    ax.bar(ranks, recomputed, bottom=kept, color=COLOURS[RECOMPUTE], label="blocks recomputed")
    for r, stage in enumerate(stages):
        ax.text(r, stage.blocks, str(stage.blocks), ha="center", va="bottom")
    ax.set_xticks(list(ranks), [f"rank {r}" for r in ranks])
    ax.set_ylabel("repeated blocks")
    ax.set_ylim(0, max((s.blocks for s in stages), default=0) * 1.2 + 1)
    ax.set_title("layers (repeated blocks) per pipeline rank")
    ax.legend(loc="upper right", fontsize="small")


# ---------------------------------------------------------------------------------------
# Collectives


def draw_collectives(fig: Figure, collectives: Sequence[Collective]) -> None:
    """Bytes per step (left, log scale) and modeled seconds per step (right) of each
    collective; a collective whose bytes the plan does not hold says so on the left."""
    left, right = fig.subplots(1, 2, sharey=True)
    if not collectives:
        left.text(0.5, 0.5, "no collectives: the plan runs on one device", ha="center")
        return
    names = [f"{c.name} [{c.axis}]" for c in collectives]
    rows = list(range(len(collectives)))
    known = [c.nbytes or 0.0 for c in collectives]
    left.barh(rows, known, color=COLOURS[FORWARD])
    for row, c in zip(rows, collectives):
        if c.nbytes is None:
            left.text(1, row, " bytes not recorded in the plan", va="center", fontsize="small")
        else:
            left.text(c.nbytes, row, f" {format_bytes(c.nbytes)}", va="center", fontsize="small")
    left.set_xscale("log")
    left.set_xlim(1, max(known + [1.0]) * 50)
    left.set_yticks(rows, names)
    left.invert_yaxis()
    left.set_xlabel("bytes moved per step, one rank (log)")
    seconds = [(c.seconds or 0.0) * 1e3 for c in collectives]
    right.barh(rows, seconds, color=COLOURS[BACKWARD])
    for row, c, ms in zip(rows, collectives, seconds):
        text = " not modeled here" if c.seconds is None else f" {ms:.3g} ms"
        right.text(ms, row, text, va="center", fontsize="small")
    right.set_xlim(0, max(seconds + [1e-6]) * 1.3)
    right.set_xlabel("modeled transfer time per step (ms, before overlap)")
    fig.suptitle("collectives per training step")


# ---------------------------------------------------------------------------------------
# Alternatives


def draw_alternatives(
    fig: Figure, plan: Plan, chosen: Sequence[bool], limit: int | None, why: str = ""
) -> None:
    """Predicted step time against peak memory, one point per plan the solver weighed,
    the chosen one starred, with `why` it was chosen under the axes."""
    ax = fig.add_subplot()
    predicted = plan.predicted
    assert predicted is not None  # write_html checks it first
    points = [(a.step_time_s, a.peak_memory_bytes) for a in plan.alternatives]
    points.append((predicted.step_time_s, predicted.peak_memory_bytes))
    largest = max(m for _, m in points)
    drawn_limit = limit is not None and limit <= OFF_SCALE * largest
    size, unit = _byte_scale(max(largest, limit or 0) if drawn_limit else largest)
    others = [a for a, c in zip(plan.alternatives, chosen) if not c]
    ax.scatter(
        [a.step_time_s * 1e3 for a in others],
        [a.peak_memory_bytes / size for a in others],
        color=COLOURS[FORWARD],
        label="alternatives",
        zorder=2,
    )
    for a in others:
        label = alternative_label(a)
        ax.annotate(
            label,
            (a.step_time_s * 1e3, a.peak_memory_bytes / size),
            fontsize=7,
            xytext=(4, 4),
            textcoords="offset points",
        )
    ax.scatter(
        [predicted.step_time_s * 1e3],
        [predicted.peak_memory_bytes / size],
        marker="*",
        s=300,
        color=CHOSEN_COLOUR,
        label=f"chosen: {plan.degrees} zero={plan.zero} (the rule below)",
        zorder=3,
    )
    if limit is not None and drawn_limit:
        ax.axhline(limit / size, color=LIMIT_COLOUR, linestyle="--", label="device limit")
    ax.margins(x=0.25, y=0.1)  # room for the labels beside the points
    ax.set_xlabel("predicted step time (ms)")
    ax.set_ylabel(f"predicted peak memory per rank ({unit})")
    ax.set_title(f"plans the solver weighed ({len(plan.alternatives)} alternatives listed)")
    ax.legend(loc="best", fontsize="small")
    if why:  # in the axis label, which the constrained layout makes room for
        ax.set_xlabel("predicted step time (ms)\n\n" + "\n".join(textwrap.wrap(why, 125)))
