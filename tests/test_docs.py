"""The README and the guides under docs/ say what autopart does today: every Python
snippet runs, every relative link resolves, and every measured figure names the script
that produced it.

A ```python block runs unless the line before it is `<!-- excerpt -->` (part of a
larger program, which the page names); docs/README.md's block marked `<!-- prelude -->`
defines the names the snippets share. A page's blocks run in this process, in order, in
one namespace that starts from the prelude's (with a fresh copy of its trainable
model), as a reader would paste them. `Mesh.local()` there is a world of one process,
ended after the page.

Most pages plan the prelude's meta-device model under other pins. The capture
`autopart.plan` makes of a meta model is kept across snippets (`_keeping_captures`):
it is the costly half of planning a small model.
"""

from __future__ import annotations

import copy
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

import autopart.api

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GUIDES = [p for p in PAGES[1:] if p.name != "README.md"]  # the index has none

FENCE = re.compile(r"^```\s*(\S*)\s*$")
MARK = re.compile(r"^<!--\s*(excerpt|prelude)\s*-->$")
# [text](target): a link's target, up to a space or the closing parenthesis.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A measured figure: a decimal (0.747, 76.1k, 2.3e-7); whole numbers are counts or pins.
FIGURE = re.compile(r"(?<![\w.])\d+\.\d+|\b\d+e-\d+\b")
# What may have produced a figure: a benchmark, its data, an example or a test.
SOURCE = re.compile(r"\b(?:benchmarks|examples|tests)/[\w/]+\.(?:py|log|jsonl|json)\b")


@dataclass(frozen=True)
class Snippet:
    page: Path
    line: int  # of the block's first line of code, counted from 1
    language: str
    code: str
    mark: str | None  # "excerpt", "prelude" or None


def snippets(page: Path) -> Iterator[Snippet]:
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if opened is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = next((s.strip() for s in reversed(lines[:i]) if s.strip()), "")
        mark = MARK.match(before)
        code = "\n".join(lines[i + 1 : end]) + "\n"
        yield Snippet(page, i + 2, opened[1], code, mark[1] if mark else None)
        i = end + 1


def sections(page: Path) -> Iterator[list[tuple[int, str]]]:
    """The page's prose by `##` section: (line number, line) outside code blocks."""
    section: list[tuple[int, str]] = []
    fenced = False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            if line.startswith("## "):
                yield section
                section = []
            section.append((number, line))
    yield section


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _compiled(snippet: Snippet) -> Any:
    """The snippet compiled under its page's name, its line numbers the page's."""
    return compile("\n" * (snippet.line - 1) + snippet.code, _name(snippet.page), "exec")


@cache
def _prelude() -> dict[str, Any]:
    (prelude,) = [s for s in snippets(ROOT / "docs" / "README.md") if s.mark == "prelude"]
    names: dict[str, Any] = {"__name__": "__docs__"}
    exec(_compiled(prelude), names)
    return names


_KEPT: dict[tuple[int, str], tuple[Any, Any]] = {}


def _keeping_captures(capturing: Callable[..., Any]) -> Callable[..., Any]:
    """`captured_for_planning`, where `autopart.plan` asks it for a meta model, keeping
    the capture with the model (so that its id stays its own): planning reads the
    captured graph without changing it, and a meta model's capture does not depend on
    its values, which it has none of."""
    plan = autopart.api.plan.__code__

    def captured(model, example_inputs, example_kwargs=None, autocast=None, **options):
        params = list(model.parameters())
        meta = bool(params) and all(p.is_meta for p in params)
        if sys._getframe(1).f_code is not plan or not meta or example_kwargs or autocast:
            return capturing(model, example_inputs, example_kwargs, autocast, **options)
        leaves = pytree.tree_leaves(example_inputs)
        key = (id(model), repr([(t.shape, t.dtype) for t in leaves]), repr(sorted(options.items())))
        if key not in _KEPT:
            _KEPT[key] = (model, capturing(model, example_inputs, **options))
        return _KEPT[key][1]

    return captured


@pytest.fixture
def page_state():
    """What a page's snippets change in this process, restored after it: the random
    state, dynamo's compiled code, and a world of one process for `Mesh.local()`."""
    began = dist.is_initialized()
    with torch.random.fork_rng():
        yield
    torch._dynamo.reset()
    if dist.is_initialized() and not began:
        dist.destroy_process_group()


# Pages whose snippets train on worlds of their own: run with the slow sweeps.
SLOW_PAGES = {"data-parallel.md", "plans.md", "compile.md"}


@pytest.mark.parametrize(
    "page",
    [pytest.param(p, marks=pytest.mark.slow) if p.name in SLOW_PAGES else p for p in PAGES],
    ids=[_name(p) for p in PAGES],
)
def test_the_snippets_run(page, tmp_path, monkeypatch, page_state):
    monkeypatch.chdir(tmp_path)  # what snippets write lands here
    planning = _keeping_captures(autopart.api.captured_for_planning)
    monkeypatch.setattr(autopart.api, "captured_for_planning", planning)
    names = dict(_prelude())
    names["model"] = copy.deepcopy(names["model"])  # trained in place by parallelize
    for s in snippets(page):
        if s.language == "python" and s.mark is None:
            exec(_compiled(s), names)


def test_most_snippets_run():
    """Excerpts are the exception, and every guide opens with a snippet."""
    blocks = [s for p in PAGES for s in snippets(p) if s.language == "python"]
    excerpts = [f"{_name(s.page)}:{s.line}" for s in blocks if s.mark == "excerpt"]
    assert len(blocks) >= 25
    assert len(excerpts) <= len(blocks) // 5, excerpts


def test_each_guide_opens_with_what_it_is_for_and_a_snippet():
    """A title, words saying what the page is for, then a snippet, all before the first
    section."""
    for page in GUIDES:
        text = page.read_text()
        assert text.startswith("# "), _name(page)
        head = text.split("\n## ")[0]
        assert "\n```" in head, f"{_name(page)}: no snippet before its first section"
        words = head.split("\n```")[0].splitlines()[1:]
        assert sum(bool(w.strip()) for w in words) >= 2, f"{_name(page)}: no opening words"


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for the page's headings."""
    titles = [line for _, line in sum(sections(page), []) if line.startswith("#")]
    slugs = (t.lstrip("#").strip().lower().replace("`", "") for t in titles)
    return {re.sub(r"[^\w\- ]", "", s).replace(" ", "-") for s in slugs}


def test_relative_links_resolve():
    """Every link that is not a web address names a file of the repository, and its
    #anchor a heading there."""
    broken = []
    for page in [*PAGES, ROOT / "ARCHITECTURE.md"]:
        for number, line in sum(sections(page), []):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):
                    continue
                path, _, anchor = target.partition("#")
                resolved = (page.parent / path).resolve() if path else page
                if not resolved.exists():
                    broken.append(f"{_name(page)}:{number}: {target}: no such file")
                elif anchor and anchor not in _anchors(resolved):
                    broken.append(f"{_name(page)}:{number}: {target}: no such heading")
    assert not broken, "\n".join(broken)


def test_measured_figures_name_the_script_that_produced_them():
    """A section quoting a measured figure (a decimal, outside code) names the benchmark,
    example or test that produced it; every script named exists."""
    unsourced, absent = [], []
    for page in PAGES:
        for section in sections(page):
            named = [m for _, line in section for m in SOURCE.findall(line)]
            absent += [f"{_name(page)}: {n}" for n in named if not (ROOT / n).exists()]
            for number, line in section:
                figure = FIGURE.search(re.sub(r"`[^`]*`", "", line))
                if figure and not named:
                    unsourced.append(f"{_name(page)}:{number}: {figure[0]} in {line.strip()}")
                    break
    assert not absent, "named, but not in the repository:\n" + "\n".join(absent)
    assert not unsourced, "figures whose section names no script:\n" + "\n".join(unsourced)


def test_the_benchmarks_page_describes_every_benchmark():
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    scripts = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py"))
    assert [s for s in scripts if f"benchmarks/{s}" not in page] == []


def test_the_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 160


def test_the_zoo_table_refuses_no_data_parallel_pin_of_a_model_that_mixes_its_batch():
    """BatchNorm CNNs and CLIP-style models train under DP2 and ZeRO-3 as on one device
    (tests/runtime/test_model_zoo.py): the model zoo's table says so."""
    lines = (ROOT / "docs" / "benchmarks.md").read_text().splitlines()
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in lines if line.startswith("|")]
    header = next(r for r in rows if r[:1] == ["model"] and "DP2" in r)
    mixing = {"CNN with BatchNorm", "ResNet", "MobileNetV2", "EfficientNet", "CLIP"}
    mixing.add("two-tower (CLIP-style)")
    cells = {r[0]: dict(zip(header, r, strict=True)) for r in rows if r[0] in mixing}
    assert cells.keys() == mixing
    refused = [(m, pin, c[pin]) for m, c in cells.items() for pin in ("DP2", "ZeRO-3")]
    assert [r for r in refused if not r[2].startswith("✓")] == []
