"""The plan report: the pipeline timeline replay, the HTML page and its figures, the
`--html` option, and (where Chromium is installed) a screenshot of the page."""

from __future__ import annotations

import html
import shutil
import subprocess
import sys

import numpy as np
import pytest

import autopart
from autopart.cli import main
from autopart.cost_models.predict import STEP_SUMS_BYTES
from autopart.plan_format import CHOICE_RULE, alternative_gap, alternative_label, format_bytes
from autopart.report import MatplotlibMissing, write_html
from autopart.report.collectives import step_collectives
from autopart.report.html import (
    FIGURES,
    choice_note,
    chosen_index,
    figure_boxes,
    plan_label,
)
from autopart.report.schedule import (
    BACKWARD,
    FORWARD,
    IDLE,
    RECOMPUTE,
    Slot,
    StageDurations,
    idle_fraction,
    simulate,
)
from tests.models import SEQ, tiny_llama, token_batch

HIDDEN = 64  # tiny_llama's hidden size
BATCH = 32

# ---------------------------------------------------------------------------------------
# The timeline replay


def _ops(timeline: list[list[Slot]]) -> dict[tuple[str, int, int], tuple[float, float]]:
    """(kind, chunk, microbatch) -> (start, end); a backward starts with its recompute."""
    ops: dict[tuple[str, int, int], tuple[float, float]] = {}
    for rank in timeline:
        for s in rank:
            if s.kind == IDLE:
                continue
            kind = BACKWARD if s.kind == RECOMPUTE else s.kind
            start, end = ops.get((kind, s.chunk, s.microbatch), (s.start, s.end))
            ops[(kind, s.chunk, s.microbatch)] = (min(start, s.start), max(end, s.end))
    return ops


UNEQUAL = [StageDurations(1.0, 2.5, 0.5), StageDurations(1.5, 2.0), StageDurations(0.7, 1.9, 0.3)]
CASES = [
    ("gpipe", 1, 3, 5),
    ("1f1b", 1, 3, 5),
    ("1f1b", 1, 2, 1),
    ("interleaved-1f1b", 2, 3, 6),
    ("interleaved-1f1b", 3, 2, 4),
]


@pytest.mark.parametrize(("schedule", "v", "p", "m"), CASES)
def test_the_replay_respects_every_dependency(schedule, v, p, m):
    timeline = simulate(UNEQUAL[:p], m, schedule, v)
    ops = _ops(timeline)
    chunks = p * v
    assert len(ops) == 2 * chunks * m  # every forward and backward, once
    for (kind, c, mb), (start, _) in ops.items():
        if kind == FORWARD and c > 0:
            assert start >= ops[(FORWARD, c - 1, mb)][1] - 1e-12
        if kind == BACKWARD:
            before = (FORWARD, c, mb) if c == chunks - 1 else (BACKWARD, c + 1, mb)
            assert start >= ops[before][1] - 1e-12
    for r, rank in enumerate(timeline):
        assert {s.chunk % p for s in rank if s.kind != IDLE} == {r}
        for a, b in zip(rank, rank[1:]):  # back to back, never overlapping
            assert a.end == pytest.approx(b.start)
    step = max(rank[-1].end for rank in timeline)
    assert all(rank[0].start == 0 and rank[-1].end == pytest.approx(step) for rank in timeline)


def test_one_f_one_b_warms_up_then_alternates():
    p, m = 4, 7
    timeline = simulate([StageDurations(1.0, 2.0)] * p, m, "1f1b")
    for r, rank in enumerate(timeline):
        kinds = [s.kind for s in rank if s.kind != IDLE]
        warmup = p - 1 - r
        expected = [FORWARD] * warmup + [FORWARD, BACKWARD] * (m - warmup) + [BACKWARD] * warmup
        assert kinds == expected, r
        forwards = [s.microbatch for s in rank if s.kind == FORWARD]
        backwards = [s.microbatch for s in rank if s.kind == BACKWARD]
        assert forwards == backwards == list(range(m))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(2, 1), (2, 4), (3, 3), (4, 8), (4, 16)])
def test_equal_stages_idle_as_the_textbook_bubble(schedule, p, m):
    timeline = simulate([StageDurations(1.0, 2.0)] * p, m, schedule)
    assert idle_fraction(timeline) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize(("p", "m", "v"), [(2, 4, 2), (4, 8, 2), (2, 6, 3)])
def test_interleaving_shrinks_the_bubble_by_the_chunks(p, m, v):
    timeline = simulate([StageDurations(1.0, 2.0)] * p, m, "interleaved-1f1b", v)
    assert idle_fraction(timeline) == pytest.approx((p - 1) / (v * m + p - 1))


def test_without_a_pipeline_microbatches_run_one_after_another():
    (rank,) = simulate([StageDurations(1.0, 2.0, 0.5)], 2, None)
    assert [(s.kind, s.microbatch) for s in rank] == [
        (FORWARD, 0),
        (RECOMPUTE, 0),
        (BACKWARD, 0),
        (FORWARD, 1),
        (RECOMPUTE, 1),
        (BACKWARD, 1),
    ]
    assert rank[1].end - rank[1].start == pytest.approx(0.5)
    assert rank[-1].end == pytest.approx(7.0)


def test_interleaving_runs_any_count_torch_accepts():
    """pp=2 with 3 microbatches is one round of 3, as torch's schedule runs it; pp=4
    with 9 is two rounds that cannot be equal, which torch refuses too."""
    slots = simulate([StageDurations(1.0, 2.0)] * 2, 3, "interleaved-1f1b", 2)
    for rank in slots:
        done = [(s.kind, s.chunk, s.microbatch) for s in rank if s.kind in (FORWARD, BACKWARD)]
        assert len(done) == 2 * 3 * 2  # every microbatch through both chunks, both ways
    with pytest.raises(ValueError, match="equal rounds"):
        simulate([StageDurations(1.0, 2.0)] * 4, 9, "interleaved-1f1b", 2)


# ---------------------------------------------------------------------------------------
# The page


@pytest.fixture(scope="module")
def pipeline_plan() -> autopart.Plan:
    """A real plan: a 4-layer Llama on 2×8 H100s, pp=2 1F1B, the rest the solver's."""
    ids = token_batch(batch=BATCH)[0]
    mesh = autopart.Mesh.cluster("h100-80g", nodes=2, per_node=8)
    return autopart.plan(tiny_llama(layers=4), mesh, (ids,), pp=2, schedule="1f1b", microbatches=4)


def test_the_page_holds_the_five_figures(pipeline_plan, tmp_path):
    plan = pipeline_plan
    assert plan.pp == 2 and len(plan.alternatives) > 1
    path = write_html(plan, tmp_path / "report")
    assert path == tmp_path / "report" / "index.html"
    text = path.read_text()
    for name, _ in FIGURES:
        assert f'<img id="{name}" class="figure" alt="' in text
    assert text.count('src="data:image/png;base64,') == len(FIGURES) == 5
    assert "model.layers.2" in text  # the stage cut, in the layers table
    assert text.count("<tr><td>chosen</td>") == 1  # the alternatives table marks the plan
    assert f"<tr><td>chosen</td><td>{html.escape(plan_label(plan))}</td>" in text
    assert html.escape(f"Chosen as {CHOICE_RULE}.") in text  # and says why


def test_the_chosen_plan_is_matched_by_its_label_and_its_reason_names_the_fastest(
    pipeline_plan,
):
    plan = pipeline_plan
    i = chosen_index(plan)
    assert i is not None and alternative_label(plan.alternatives[i]) == plan_label(plan)
    fastest = min(plan.alternatives, key=lambda a: a.step_time_s)
    note = choice_note(plan)
    assert note.startswith(f"Chosen as {CHOICE_RULE}.")
    if fastest is not plan.alternatives[i]:
        assert alternative_label(fastest) in note and alternative_gap(plan, fastest) in note


@pytest.fixture(scope="module")
def tp_plan() -> autopart.Plan:
    """A 2-layer Llama with tp=2 on 2 H100s."""
    ids = token_batch(batch=8)[0]
    mesh = autopart.Mesh.cluster("h100-80g", nodes=1, per_node=2)
    return autopart.plan(tiny_llama(layers=2), mesh, (ids,), tp=2)


def test_tensor_parallel_collectives_carry_the_bytes_and_calls_explain_lists(tp_plan, tmp_path):
    plan = tp_plan
    assert plan.predicted is not None and plan.predicted.resharding
    found = [c for c in step_collectives(plan) if c.axis == "tp"]
    sites = plan.predicted.resharding
    assert sum(c.calls or 0 for c in found) == sum(r.count for r in sites)
    assert sum(c.nbytes or 0 for c in found) == sum(r.count * r.bytes_each for r in sites)
    assert {c.op for c in found} == {r.collective for r in sites}
    text = write_html(plan, tmp_path).read_text()
    assert "not recorded" not in text
    for c in found:
        assert c.nbytes is not None
        cells = [c.op, "tp", "2", str(c.calls), format_bytes(c.nbytes)]
        assert "".join(f"<td>{cell}</td>" for cell in cells) in text
    site = sites[0]
    assert f"{site.count} × {format_bytes(site.bytes_each)}" in plan.explain()


def test_no_two_legend_entries_share_a_colour():
    from autopart.report.figures import CHOSEN_COLOUR, COLOURS, LIMIT_COLOUR, PART_COLOURS

    memory = [*PART_COLOURS.values(), LIMIT_COLOUR]
    alternatives = [COLOURS[FORWARD], CHOSEN_COLOUR, LIMIT_COLOUR]
    timeline = list(COLOURS.values())
    for colours in (memory, alternatives, timeline):
        assert len(set(colours)) == len(colours)


def test_the_collectives_follow_from_the_plan(pipeline_plan):
    """The stage transfer is one microbatch's activation, dp sync moves the stage's
    gradients, tp collectives (none here) would be times only."""
    plan = pipeline_plan
    found = {c.axis: c for c in step_collectives(plan)}
    rows = BATCH // (plan.dp * plan.microbatches)
    sends = 2 * plan.microbatches * plan.virtual_stages
    assert found["pp"].calls == sends
    assert found["pp"].nbytes == pytest.approx(sends * rows * SEQ * HIDDEN * 4)
    assert plan.predicted is not None
    params = plan.predicted.memory["parameters"]
    assert found["dp"].nbytes == pytest.approx(params)  # fp32 gradients of fp32 weights
    assert "tp" not in found and found["world"].nbytes == STEP_SUMS_BYTES


def test_cli_writes_the_page_and_prints_its_path(pipeline_plan, tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    pipeline_plan.save(plan_path)
    assert main(["report", str(plan_path), "--html", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "out" / "index.html")
    assert (tmp_path / "out" / "index.html").stat().st_size > 10_000


def test_without_matplotlib_the_error_says_what_to_install(
    pipeline_plan, tmp_path, monkeypatch, capsys
):
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: ImportError
    monkeypatch.delitem(sys.modules, "autopart.report.figures", raising=False)
    monkeypatch.delattr(autopart.report, "figures", raising=False)
    with pytest.raises(MatplotlibMissing, match="pip install matplotlib"):
        write_html(pipeline_plan, tmp_path)
    plan_path = tmp_path / "plan.json"
    pipeline_plan.save(plan_path)
    assert main(["report", str(plan_path), "--html", str(tmp_path)]) == 2
    assert "autopart[report]" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------
# The page in a browser


def _screenshot(page, png, width: int = 1200, height: int = 3000) -> np.ndarray:
    """Chromium's rendering of `page` as an (height, width, 3) array of 0-255 ints."""
    from matplotlib.image import imread

    command = [
        "chromium",
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        f"--screenshot={png}",
        f"--window-size={width},{height}",
        page.as_uri(),
    ]
    subprocess.run(command, check=True, capture_output=True, timeout=120)
    return np.round(imread(png)[..., :3] * 255).astype(int)


def _colours(region: np.ndarray, least: int) -> set[tuple[int, int, int]]:
    """The colours covering at least `least` pixels of `region`."""
    values, counts = np.unique(region.reshape(-1, 3), axis=0, return_counts=True)
    return {(int(r), int(g), int(b)) for (r, g, b), n in zip(values, counts) if n >= least}


def _hex(colour: str) -> tuple[int, int, int]:
    return int(colour[1:3], 16), int(colour[3:5], 16), int(colour[5:7], 16)


def _signatures() -> dict[str, list[tuple[str, str, int]]]:
    """Per figure, (what, colour, least pixels) that only its drawing puts on the page:
    the fills of its bars, slots and markers (text and tables never use them)."""
    from autopart.report.figures import CHOSEN_COLOUR, COLOURS, PART_COLOURS

    return {
        "timeline": [(k, COLOURS[k], 2000) for k in (FORWARD, BACKWARD, IDLE)],
        "memory": [(k, PART_COLOURS[k], 1000) for k in ("parameters", "gradients", "activations")],
        "layers": [("blocks", COLOURS[FORWARD], 2000)],
        "collectives": [("bytes", COLOURS[FORWARD], 1000), ("time", COLOURS[BACKWARD], 1000)],
        "alternatives": [("chosen", CHOSEN_COLOUR, 100), ("others", COLOURS[FORWARD], 50)],
    }


@pytest.mark.slow  # a headless browser renders the page
@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs chromium (headless)")
def test_the_browser_shows_the_figures(pipeline_plan, tmp_path):
    """Each figure's box on the page (the page's fixed layout) is drawn on, in several
    colours, and holds its own fills: the timeline's forward, backward and idle
    colours, the memory parts, ... A page whose images fail to load has text there."""
    page = write_html(pipeline_plan, tmp_path / "report")
    shot = _screenshot(page, tmp_path / "shot.png")
    assert shot.shape == (3000, 1200, 3)
    signatures = _signatures()
    for name, (left, top, width, height) in figure_boxes().items():
        box = shot[top : top + height, left : left + width]
        drawn = (box < 245).any(axis=-1).mean()
        assert drawn > 0.03, f"{name}: only {drawn:.1%} of its box is drawn"
        assert len(_colours(box, 150)) >= 3, f"{name}: too few colours"
        for what, colour, least in signatures[name]:
            pixels = int((box == np.array(_hex(colour))).all(axis=-1).sum())
            assert pixels >= least, f"{name}: {pixels} pixels of {what} ({colour})"
    bottom = max(top + height for _, top, _, height in figure_boxes().values())
    below = shot[bottom + 20 :]  # the tables and the plan as text
    assert (below < 245).any(axis=-1).mean() > 0.005


def test_an_expert_parallel_plan_lists_its_all_to_alls_and_its_sync_over_dp_and_ep():
    from tests.models import tiny_mixtral, token_batch

    ids, _ = token_batch(8)
    mesh = autopart.Mesh.cluster("h100-80g", nodes=1, per_node=2)
    plan = autopart.plan(tiny_mixtral(), mesh, (ids,), ep=2)
    found = {c.name: c for c in step_collectives(plan)}
    exchanges = found["expert all_to_alls, pipeline rank 0"]
    assert (exchanges.op, exchanges.axis, exchanges.group) == ("all_to_all", "ep", 2)
    assert exchanges.seconds is not None and exchanges.seconds > 0
    sync = found["gradient sync"]
    assert (sync.axis, sync.group) == ("dp×ep", 2) and sync.seconds > 0
