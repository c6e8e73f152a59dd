"""The package's layers, enforced: every import points down.

    api, cli, compile, calibrate, testing     entry points: anything
    solver                                     → cost_models, capture, passes, ops
    cost_models                                → passes, ops
    capture                                    → passes (the pass context), ops
    passes          runtime                    → ops (never each other)
    ops                                        → the foundation only
    foundation: mesh, degrees, policy, plan, plan_format, placements, batch, heap

Imports under TYPE_CHECKING and inside functions count too: a cycle that only type
annotations or a lazy import hide is still a cycle in the design.
"""

from __future__ import annotations

import ast
from pathlib import Path

import autopart

PACKAGE = Path(autopart.__file__).parent

FOUNDATION = {"mesh", "degrees", "policy", "plan", "plan_format", "placements", "batch", "heap"}
BASE = {"foundation", "ops"}
ALLOWED = {
    "foundation": set(),
    "ops": {"foundation"},
    "passes": BASE,
    "runtime": BASE,
    "capture": BASE | {"passes"},
    "cost_models": BASE | {"passes"},
    "solver": BASE | {"passes", "capture", "cost_models"},
}


def _unit(module: str) -> str:
    """The layer unit of a dotted module name inside autopart."""
    parts = module.split(".")
    head = parts[1] if len(parts) > 1 else "__init__"
    if head in FOUNDATION:
        return "foundation"
    return head if head in ALLOWED else "entry"  # api, cli, compile, calibrate, testing


def _imports(module: str, source: str) -> list[tuple[int, str]]:
    """(line, imported autopart module) for every import in `source`, at any depth."""
    package = module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            name = ".".join(p for p in (base, node.module) if p)
            found.append((node.lineno, name))
            # `from autopart import runtime` names the subpackage in the alias.
            found += [(node.lineno, f"{name}.{a.name}") for a in node.names]
    return [(line, name) for line, name in found if name.startswith("autopart.")]


def violations(sources: dict[str, str]) -> list[str]:
    """Each import in `sources` (module name -> text) that points up or sideways."""
    out = []
    for module, source in sorted(sources.items()):
        src = _unit(module)
        for line, name in _imports(module, source):
            dst = _unit(name)
            if src != "entry" and dst != src and dst not in ALLOWED[src]:
                out.append(f"{module}:{line}: {src} imports {name} ({dst})")
    return out


def _package_sources() -> dict[str, str]:
    sources = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1] + ("__init__",)  # relative imports resolve inside the package
        sources[".".join(("autopart", *parts))] = path.read_text()
    return sources


def test_every_import_points_down():
    assert violations(_package_sources()) == []


def test_imports_against_the_layers_are_caught():
    wrong = {
        "autopart.passes.x": "from autopart.runtime.pipeline import PipelineExecutor",
        "autopart.cost_models.x": "import autopart.runtime.zero",
        "autopart.runtime.x": "from autopart.passes import analyze",
        "autopart.ops.x": "from autopart import passes",
        "autopart.solver.x": "def f():\n    from autopart.api import plan",
        "autopart.runtime.y": "from ..passes.meta import SHAPE",
    }
    found = violations(wrong)
    assert sorted({v.split(":")[0] for v in found}) == sorted(wrong), found
    ok = {
        "autopart.runtime.x": "from autopart.ops.groups import MeshGroups",
        "autopart.api": "from autopart.runtime import parallel_module",
    }
    assert violations(ok) == []
