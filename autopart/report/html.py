"""A plan as one self-contained HTML page: `write_html(plan, directory)`.

The page shows what the printed plan states in numbers as pictures: the pipeline
timeline, memory per rank against the device, layers per stage, the step's
collectives and the alternatives the solver weighed. Figures are PNGs embedded as
base64 `<img>`s, so `index.html` can be mailed or attached to a CI run alone.

The figures come first, full width, one under the other, at fixed pixel sizes
(`FIGURES`, `HEADER_PX`, `GAP_PX`), so where each lies on the page is known
(`figure_boxes`): the screenshot test reads it. Tables and notes follow them.

matplotlib is imported only here, only when a page is written (`_images`), so the
rest of autopart does not depend on it.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from autopart.degrees import MeshError
from autopart.mesh import device_spec
from autopart.plan import Alternative, Plan, Predicted
from autopart.plan_format import (
    CHOICE_RULE,
    alternative_gap,
    alternative_label,
    format_bytes,
)
from autopart.report.collectives import Collective, recorded_rank, step_collectives
from autopart.report.schedule import (
    FORWARD_SHARE,
    Slot,
    idle_fraction,
    plan_timeline,
    stage_durations,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

PAGE_WIDTH_PX = 1160  # leaves room for a scroll bar in a 1200-pixel window
HEADER_PX = 90
GAP_PX = 10
FIGURE_WIDTH_PX = PAGE_WIDTH_PX - 2 * GAP_PX
# (id, height in pixels), in page order.
FIGURES: tuple[tuple[str, int], ...] = (
    ("timeline", 420),
    ("memory", 380),
    ("layers", 300),
    ("collectives", 360),
    ("alternatives", 440),
)
ALT_TEXT = {
    "timeline": "Pipeline timeline: per rank, forward, backward, recompute and idle time "
    "of every microbatch in one training step",
    "memory": "Peak memory per pipeline rank, stacked by part, against the device limit",
    "layers": "Repeated blocks per pipeline rank, recomputed ones apart",
    "collectives": "Collectives of one training step: bytes moved and modeled time",
    "alternatives": "Predicted step time against peak memory of the plans the solver "
    "weighed, the chosen plan starred",
}
MISSING_MATPLOTLIB = (
    "the HTML report draws its figures with matplotlib, which is not installed: "
    "pip install matplotlib (or pip install 'autopart[report]')"
)


class MatplotlibMissing(ImportError):
    """`write_html` needs matplotlib, an optional dependency (the `report` extra)."""


def figure_boxes() -> dict[str, tuple[int, int, int, int]]:
    """Where each figure lies on the page: id -> (left, top, width, height) in CSS
    pixels, from the page's fixed layout."""
    boxes = {}
    top = HEADER_PX + GAP_PX
    for name, height in FIGURES:
        boxes[name] = (GAP_PX, top, FIGURE_WIDTH_PX, height)
        top += height + GAP_PX
    return boxes


def write_html(plan: Plan, directory: str | Path) -> Path:
    """Write the plan's report to `directory`/index.html (creating the directory) and
    return that path."""
    if plan.predicted is None or not plan.predicted.stages:
        raise ValueError("the plan carries no predictions to draw: make it with autopart.plan()")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "index.html"
    path.write_text(page(plan), encoding="utf-8")
    return path


def page(plan: Plan) -> str:
    """The whole HTML page of a plan with predictions."""
    predicted = plan.predicted
    assert predicted is not None  # write_html checks it
    limit = _device_limit(plan)
    collectives = step_collectives(plan)
    timeline = plan_timeline(plan)
    images = _images(plan, predicted, timeline, limit, collectives)
    body = [
        _header(plan, predicted),
        *(_img(name, png) for name, png in images),
        _timeline_section(plan, timeline),
        _memory_section(plan, predicted, limit),
        _layers_section(plan, predicted),
        _collectives_section(collectives),
        _alternatives_section(plan),
        _text_section(plan),
    ]
    return _document(f"autopart plan report: {plan.degrees}", "\n".join(body))


# ---------------------------------------------------------------------------------------
# Figures


def _images(
    plan: Plan,
    predicted: Predicted,
    timeline: list[list[Slot]],
    limit: int | None,
    collectives: Sequence[Collective],
) -> list[tuple[str, bytes]]:
    """(id, PNG) of each figure, in `FIGURES` order. `report.figures` imports
    matplotlib: imported here, so only a page needs it."""
    try:
        from autopart.report import figures
    except ImportError as e:
        if (e.name or "").split(".")[0] == "matplotlib":
            raise MatplotlibMissing(MISSING_MATPLOTLIB) from e
        raise
    draws: dict[str, Callable[[Figure], None]] = {
        "timeline": lambda fig: figures.draw_timeline(fig, timeline, _schedule(plan)),
        "memory": lambda fig: figures.draw_memory(fig, predicted, limit),
        "layers": lambda fig: figures.draw_layers(fig, predicted),
        "collectives": lambda fig: figures.draw_collectives(fig, collectives),
        "alternatives": lambda fig: figures.draw_alternatives(
            fig, plan, _chosen(plan), limit, choice_note(plan)
        ),
    }
    out = []
    for name, height in FIGURES:
        fig = figures.new_figure(FIGURE_WIDTH_PX, height)
        draws[name](fig)
        out.append((name, figures.png_bytes(fig)))
    return out


def _img(name: str, png: bytes) -> str:
    """The figure inline, at its fixed size (the layout holds before it loads)."""
    data = base64.b64encode(png).decode("ascii")
    height = dict(FIGURES)[name]
    return (
        f'<img id="{name}" class="figure" alt="{html.escape(ALT_TEXT[name])}" '
        f'width="{FIGURE_WIDTH_PX}" height="{height}" src="data:image/png;base64,{data}">'
    )


# ---------------------------------------------------------------------------------------
# Sections


def _header(plan: Plan, predicted: Predicted) -> str:
    summary = (
        f"{plan.mesh} ({plan.mesh.world_size} devices), {plan.precision}, global batch "
        f"{plan.global_batch}: predicted step {predicted.step_time_s * 1e3:.2f} ms, "
        f"peak memory {format_bytes(predicted.peak_memory_bytes)} per rank"
    )
    return (
        f"<header><h1>autopart plan: {html.escape(str(plan.degrees))}, zero={plan.zero}</h1>"
        f"<p>{html.escape(_schedule(plan))}</p><p>{html.escape(summary)}</p></header>"
    )


def _schedule(plan: Plan) -> str:
    if plan.pp == 1:
        return f"no pipeline, {plan.microbatches} microbatch(es) accumulated"
    v = f", {plan.virtual_stages} chunks per rank" if plan.virtual_stages > 1 else ""
    return f"{plan.schedule}, pp={plan.pp}, {plan.microbatches} microbatches{v}"


def _timeline_section(plan: Plan, timeline: list[list[Slot]]) -> str:
    rows = [
        [f"rank {r}", _ms(d.forward), _ms(d.recompute), _ms(d.backward)]
        for r, d in enumerate(stage_durations(plan))
    ]
    bubble = idle_fraction(timeline)
    note = (
        f"The schedule replayed on the plan's per-stage times (<code>autopart/report/"
        f"schedule.py</code>). The plan records each stage's time per microbatch, not its "
        f"split: forward is drawn as {FORWARD_SHARE:.0%} of it and backward as the rest, "
        f"after recomputation is set apart. Transfers are inside those times. Idle time "
        f"is {bubble:.1%} of all ranks' time in the step."
    )
    table = _table(["rank", "forward (ms)", "recompute (ms)", "backward (ms)"], rows)
    return _section("timeline-notes", "Pipeline timeline", note, table)


def _memory_section(plan: Plan, predicted: Predicted, limit: int | None) -> str:
    rank = recorded_rank(predicted)
    parts = [[part, format_bytes(n)] for part, n in predicted.memory.items()]
    totals = [
        [f"rank {r}", format_bytes(s.peak_memory_bytes)] for r, s in enumerate(predicted.stages)
    ]
    device = format_bytes(limit) if limit is not None else "unknown here"
    note = (
        f"The plan keeps the breakdown of one rank, pipeline rank {rank} (the largest); "
        f"for the others it keeps their total. The device ({html.escape(plan.mesh.device)}) "
        f"has {device}."
    )
    return _section(
        "memory-notes",
        "Memory per rank",
        note,
        _table([f"part (rank {rank})", "bytes"], parts) + _table(["rank", "peak"], totals),
    )


def _layers_section(plan: Plan, predicted: Predicted) -> str:
    chunks = plan.pp * plan.virtual_stages
    starts = ["the model's start", *plan.stage_cuts][:chunks]
    rows = [[str(c), f"rank {c % plan.pp}", html.escape(s)] for c, s in enumerate(starts)]
    note = (
        "Blocks per rank from the plan's predictions; stage c runs on rank c mod pp and "
        "begins at the module its cut names."
    )
    if plan.recompute:
        note += f" Recomputed: {html.escape(', '.join(plan.recompute))}."
    return _section(
        "layers-notes", "Layers per stage", note, _table(["stage", "rank", "begins at"], rows)
    )


def _collectives_section(collectives: Sequence[Collective]) -> str:
    rows = [
        [
            html.escape(c.name),
            c.op,
            c.axis,
            str(c.group),
            "?" if c.calls is None else str(c.calls),
            "not recorded" if c.nbytes is None else format_bytes(c.nbytes),
            "?" if c.seconds is None else f"{c.seconds * 1e3:.4f}",
            html.escape(c.note),
        ]
        for c in collectives
    ]
    note = (
        "One rank's collectives per step (the rank whose memory breakdown the plan keeps), "
        "derived from the plan's predictions with the cost models' rules; times from the "
        "communication model, before overlap with compute. Tensor-parallel collectives "
        "carry the calls and bytes the plan records per resharding site (as "
        "<code>explain()</code> lists them), summed by collective over the pipeline's "
        "stages; a plan saved without them shows their time alone."
    )
    head = ["collective", "op", "axis", "group", "calls", "bytes", "time (ms)", "note"]
    return _section("collectives-notes", "Collectives", note, _table(head, rows))


def plan_label(plan: Plan) -> str:
    """What the plan switches on, in the words of its alternatives' labels."""
    return alternative_label(
        Alternative(
            plan.degrees,
            plan.zero,
            plan.microbatches,
            plan.schedule,
            0.0,
            0,
            virtual_stages=plan.virtual_stages,
            sequence_parallel=plan.sequence_parallel,
            recompute=len(plan.recompute),
            recompute_attention=len(plan.recompute_attention),
            offload=plan.offload,
        )
    )


def chosen_index(plan: Plan) -> int | None:
    """Which of the plan's alternatives is the plan itself: the one whose label (what it
    switches on, its note aside) is the plan's; of several, the one nearest the plan's
    predicted step time. None where none is."""
    label = plan_label(plan)
    same = [i for i, a in enumerate(plan.alternatives) if _bare_label(a) == label]
    if not same:
        return None
    step = plan.predicted.step_time_s if plan.predicted is not None else 0.0
    return min(same, key=lambda i: abs(plan.alternatives[i].step_time_s - step))


def _bare_label(alt: Alternative) -> str:
    return alternative_label(replace(alt, note=""))


def is_chosen(plan: Plan, alt: Alternative) -> bool:
    """Whether an alternative is the plan itself (`chosen_index`)."""
    i = chosen_index(plan)
    return i is not None and plan.alternatives[i] is alt


def _chosen(plan: Plan) -> list[bool]:
    i = chosen_index(plan)
    return [j == i for j in range(len(plan.alternatives))]


def choice_note(plan: Plan) -> str:
    """Why the plan was chosen, and how the fastest it left compares."""
    note = f"Chosen as {CHOICE_RULE}."
    if plan.alternatives:
        fastest = min(plan.alternatives, key=lambda a: a.step_time_s)
        gap = alternative_gap(plan, fastest)
        if _bare_label(fastest) != plan_label(plan) and gap:
            note += f" The fastest listed, {alternative_label(fastest)}, differs by {gap}."
    return note


def _alternatives_section(plan: Plan) -> str:
    chosen = _chosen(plan)
    rows = [
        [
            "chosen" if c else "",
            html.escape(alternative_label(a)),
            _ms(a.step_time_s),
            format_bytes(a.peak_memory_bytes),
            "" if c else html.escape(alternative_gap(plan, a)),
        ]
        for a, c in zip(plan.alternatives, chosen)
    ]
    head = ["", "what it switches on", "step (ms)", "peak", "against the chosen plan"]
    note = (
        f"{len(plan.alternatives)} plans listed by the solver, fastest first. "
        f'<span id="choice-rule">{html.escape(choice_note(plan))}</span>'
    )
    return _section("alternatives-notes", "Alternatives", note, _table(head, rows))


def _text_section(plan: Plan) -> str:
    text = f"{plan}\n\n{plan.explain()}"
    return _section("plan-text", "The plan as text", "", f"<pre>{html.escape(text)}</pre>")


# ---------------------------------------------------------------------------------------
# HTML pieces


def _device_limit(plan: Plan) -> int | None:
    """The device's memory from its preset; None for a profile not on this machine."""
    try:
        return device_spec(plan.mesh.device).memory_bytes
    except MeshError:
        return None


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A table of already escaped cells."""
    th = "".join(f"<th>{h}</th>" for h in head)
    trs = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{trs}</tbody></table>"


def _section(section_id: str, title: str, note: str, content: str) -> str:
    paragraph = f"<p>{note}</p>" if note else ""
    return f'<section id="{section_id}"><h2>{title}</h2>{paragraph}{content}</section>'


STYLE = f"""
body {{ margin: 0; font-family: sans-serif; width: {PAGE_WIDTH_PX}px; color: #222; }}
header {{ height: {HEADER_PX}px; overflow: hidden; padding: 0 {GAP_PX}px;
          box-sizing: border-box; }}
header h1 {{ font-size: 22px; margin: 10px 0 6px; white-space: nowrap; }}
header p {{ margin: 0; font-size: 14px; }}
img.figure {{ display: block; margin: {GAP_PX}px; width: {FIGURE_WIDTH_PX}px; }}
section {{ padding: 0 {GAP_PX}px; }}
table {{ border-collapse: collapse; margin: 6px 0 12px; font-size: 13px; }}
th, td {{ border: 1px solid #ccc; padding: 2px 6px; text-align: left; }}
pre {{ font-size: 12px; white-space: pre-wrap; }}
"""


def _document(title: str, body: str) -> str:
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head>\n"
        f"<body>\n{body}\n</body></html>\n"
    )
