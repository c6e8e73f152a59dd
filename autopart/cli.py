"""`autopart plan | report | verify | calibrate`: the command line.

    autopart plan --model pkg.module:factory --mesh h100-80g:8x8 [--tp 8 ...] --out plan.json
    autopart report plan.json [--html DIR]
    autopart verify --model pkg.module:case --plan plan.json [--world 4] [--steps 3]
    autopart calibrate [--out profile.json] [--quick] [--name NAME] [--dtypes fp32,bf16]

`factory()` returns `(model, example_inputs)`; with `--meta` it is called under the meta
device, so models far larger than this machine can be planned. The current directory is
importable, as it is to `python -m`. For `verify`, the factory returns a whole training
case, `(model, inputs, target, loss_fn, optimizer)`, each picklable (importable
functions, `functools.partial`): they go to the local Gloo processes that run the plan.

A mistake in what the user gave (an option, a model that cannot be imported, a plan
that does not fit) is said in one line with its fix, exit status 2; `--debug` shows its
traceback instead. autopart's INFO log (what the solver priced, a long solve's progress)
goes to stderr, its DEBUG log too with `-v`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from autopart.batch import BatchError
from autopart.capture import CaptureError
from autopart.degrees import MeshError
from autopart.placements import PlacementError
from autopart.plan import PlanError
from autopart.policy import PRECISION_CHOICES, PRECISIONS, SCHEDULES
from autopart.runtime.checkpoint import CheckpointError

if TYPE_CHECKING:
    from autopart.plan import Plan

# Integer pins besides the mesh axes, which are pinned by name (`--dp 8`).
INT_PINS = ("zero", "microbatches", "virtual_stages")

MESH_FORMS = (
    "DEVICE:NODESxPER_NODE (h100-80g:8x8 is 8 nodes of 8 devices, cpu:1x2 one node of 2) "
    "or DEVICE alone (one device), DEVICE being a preset or a profile JSON written by "
    "`autopart calibrate`"
)
# Where `autopart calibrate` writes without --out (--name NAME: NAME.json), in the
# current directory, where `--mesh` finds it by its relative path.
DEFAULT_PROFILE = "autopart-profile.json"


class UsageError(Exception):
    """A mistake on the command line, said with its fix."""


# What the user's input can cause: said in one line (`_one_line`), exit status 2. Any
# other exception is a fault in autopart or in the user's code, and keeps its traceback.
USER_ERRORS: tuple[type[Exception], ...] = (
    UsageError,
    PlanError,  # also a plan that does not fit (the solver's NoPlanFits, reworded)
    MeshError,
    BatchError,
    CaptureError,
    CheckpointError,
    PlacementError,
)


class _Parser(argparse.ArgumentParser):
    """argparse, its errors said in one line (not the usage block) with where to look."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (`{self.prog} --help` lists the options)\n")


def _int_pins() -> list[str]:
    from autopart.degrees import axis_names

    return [*axis_names(), *INT_PINS]


def _factory(spec: str) -> Callable[[], Any]:
    """`package.module:function`, imported from the current directory or sys.path."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise UsageError(f"--model must look like package.module:function, not {spec!r}")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does; an installed script does not
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not f"{module_name}.".startswith(f"{e.name}."):
            raise UsageError(
                f"--model {spec}: importing {module_name} failed: {e}: install it, or "
                f"mend the import in {module_name}"
            ) from e
        raise UsageError(
            f"--model {spec}: no module {module_name} in {os.getcwd()} or on the Python "
            "path: run autopart from the directory that holds it, or add that directory "
            "to PYTHONPATH"
        ) from e
    factory = getattr(module, name, None)
    if not callable(factory):
        raise UsageError(
            f"--model {spec}: {module_name} ({module.__file__}) has no function {name!r}: "
            "name a function of it that builds the model"
        )
    return factory


def _mesh(spec: str):
    from autopart.mesh import Mesh

    device, _, shape = spec.rpartition(":") if ":" in spec else (spec, "", "1x1")
    sizes = re.fullmatch(r"(\d+)[x×](\d+)", shape)
    if not device or sizes is None:
        raise UsageError(f"--mesh {spec!r} is not a mesh: write {MESH_FORMS}")
    return Mesh.cluster(device, nodes=int(sizes[1]), per_node=int(sizes[2]))


def cmd_plan(args: argparse.Namespace) -> int:
    import autopart

    mesh = _mesh(args.mesh)  # a mistake in it is said before the model is imported
    factory = _factory(args.model)
    if args.meta:
        with torch.device("meta"):
            built = factory()
    else:
        built = factory()
    if not isinstance(built, tuple) or len(built) != 2:
        raise UsageError(
            f"--model {args.model} must return (model, example_inputs), not {type(built).__name__}"
        )
    model, inputs = built
    pins = {k: getattr(args, k) for k in _int_pins() if getattr(args, k) is not None}
    plan = autopart.plan(
        model,
        mesh,
        inputs,
        precision=args.precision,
        schedule=args.schedule,
        compile=args.compile,
        **pins,
    )
    print(plan)
    if args.out:
        plan.save(args.out)
        print(f"\nwrote {args.out}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from autopart.plan import Plan

    plan = Plan.load(args.plan)
    if args.html:
        return _write_report(plan, args.html)
    print(plan, end="\n\n")
    print(plan.explain())
    return 0


def _write_report(plan: Plan, directory: str) -> int:
    """The HTML report; matplotlib is imported only here (an optional extra)."""
    from autopart.report import MatplotlibMissing, write_html

    try:
        path = write_html(plan, directory)
    except MatplotlibMissing as e:
        raise UsageError(f"--html: {e}") from e
    print(path)
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from autopart import calibrate

    out = args.out
    if out is None:
        out = f"{args.name}.json" if args.name else DEFAULT_PROFILE
        print(f"writing the profile to {Path(out).resolve()} (--out chooses another path)")
    dtypes = args.dtypes.split(",") if args.dtypes else None
    if args.quick:
        calibrate.calibrate(
            out,
            dtypes=dtypes,
            name=args.name,
            sizes=calibrate.QUICK_SIZES,
            messages=calibrate.QUICK_MESSAGES,
            copy_bytes=calibrate.QUICK_COPY_BYTES,
        )
    else:
        calibrate.calibrate(out, dtypes=dtypes, name=args.name)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    import autopart
    from autopart.plan import Plan

    plan = Plan.load(args.plan)
    if args.world is not None and args.world != plan.degrees.world_size:
        raise UsageError(
            f"--world {args.world} does not match the plan, made for "
            f"{plan.degrees.world_size} devices: verify runs a plan on a world of its own "
            "size (leave --world out)"
        )
    case = _factory(args.model)()
    if not isinstance(case, tuple) or len(case) != 5:
        raise UsageError(
            f"--model {args.model} must return (model, inputs, target, loss_fn, "
            f"optimizer), not {type(case).__name__}"
        )
    model, inputs, target, loss_fn, optimizer = case
    report = autopart.verify(model, plan, inputs, target, loss_fn, optimizer, args.steps)
    print(report)
    return 0 if report.ok else 1


def _parser() -> tuple[argparse.ArgumentParser, Mapping[str, argparse.ArgumentParser]]:
    """The command line's parser, and each command's."""
    parser = _Parser(prog="autopart")
    _add_common(parser, argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        _add_common(p, argparse.SUPPRESS)
        return p

    p = command("plan", "plan a model for a mesh and print (and save) the plan")
    p.add_argument("--model", required=True, help="package.module:factory -> (model, inputs)")
    p.add_argument("--mesh", required=True, help=MESH_FORMS)
    p.add_argument("--meta", action="store_true", help="build the model on the meta device")
    p.add_argument("--precision", default="fp32", choices=PRECISIONS + tuple(PRECISION_CHOICES))
    p.add_argument("--schedule", choices=SCHEDULES)
    p.add_argument("--compile", action="store_true", help="price the programs compiled by inductor")
    for name in _int_pins():
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int)
    p.add_argument("--out", help="write the plan JSON here")
    p.set_defaults(run=cmd_plan)

    r = command("report", "print a saved plan and explain it, or draw it as HTML")
    r.add_argument("plan")
    r.add_argument("--html", metavar="DIR", help="write DIR/index.html with the plan's figures")
    r.set_defaults(run=cmd_report)

    v = command("verify", "run a plan on local Gloo processes beside one device")
    v.add_argument("--model", required=True, help="package.module:factory -> a training case")
    v.add_argument("--plan", required=True, help="the plan JSON to check")
    v.add_argument("--world", type=int, help="processes (the plan's world size)")
    v.add_argument("--steps", type=int, default=3, help="training steps to compare")
    v.set_defaults(run=cmd_verify)

    c = command("calibrate", "measure this machine into a device profile")
    c.add_argument(
        "--out", help=f"the device profile JSON to write (default: NAME.json or {DEFAULT_PROFILE})"
    )
    c.add_argument("--quick", action="store_true", help="few sizes: seconds, not minutes")
    c.add_argument("--name", help="the profile's device name")
    c.add_argument("--dtypes", help="comma-separated: fp32,bf16,fp16")
    c.set_defaults(run=cmd_calibrate)

    # Made from the commands, so that it names every one.
    parser.description = (
        f"autopart {' | '.join(sub.choices)}: `autopart COMMAND --help` for a command's options"
    )
    return parser, sub.choices


def _add_common(parser: argparse.ArgumentParser, default: Any) -> None:
    """-v and --debug, before the command or after it (`default`: SUPPRESS, so that a
    command's parser does not overwrite what was given before the command)."""
    parser.add_argument(
        "-v", "--verbose", action="store_true", default=default, help="DEBUG log too"
    )
    parser.add_argument(
        "--debug", action="store_true", default=default, help="tracebacks for every error"
    )


@contextlib.contextmanager
def _terminal_log(level: int) -> Iterator[None]:
    """autopart's log at `level` on stderr while a command runs; the logger as it was
    afterwards, so that `main` called in-process leaves no handler behind."""
    logger = logging.getLogger("autopart")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.setLevel(level)
    before = logger.level
    logger.addHandler(handler)
    logger.setLevel(min(level, before or level))
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before)


def _one_line(message: str) -> str:
    return " ".join(message.split())


def main(argv: list[str] | None = None) -> int:
    parser, commands = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command's parser, which names its own --help
        commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    verbose, debug = getattr(args, "verbose", False), getattr(args, "debug", False)
    path = list(sys.path)
    try:
        with _terminal_log(logging.DEBUG if verbose else logging.INFO):
            return args.run(args)
    except USER_ERRORS as e:
        if debug:
            raise
        sys.stderr.write(f"autopart {args.command}: {_one_line(str(e))}\n")
        return 2
    finally:
        sys.path[:] = path


if __name__ == "__main__":
    sys.exit(main())
