"""`autopart plan | report | calibrate`: the command line.

    autopart plan --model pkg.module:factory --mesh h100-80g:8x8 [--tp 8 ...] --out plan.json
    autopart report plan.json [--html DIR]
    autopart verify --model pkg.module:case --plan plan.json [--world 4] [--steps 3]
    autopart calibrate --out profile.json [--quick] [--name NAME] [--dtypes fp32,bf16]

`factory()` returns `(model, example_inputs)`; with `--meta` it is called under the meta
device, so models far larger than this machine can be planned. For `verify`, the
factory returns a whole training case, `(model, inputs, target, loss_fn, optimizer)`,
each picklable (importable functions, `functools.partial`): they go to the local Gloo
processes that run the plan.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import TYPE_CHECKING

import torch

from autopart.policy import PRECISIONS, SCHEDULES

if TYPE_CHECKING:
    from autopart.plan import Plan

# Integer pins besides the mesh axes, which are pinned by name (`--dp 8`).
INT_PINS = ("zero", "microbatches", "virtual_stages")


def _int_pins() -> list[str]:
    from autopart.degrees import axis_names

    return [*axis_names(), *INT_PINS]


def _factory(spec: str):
    module_name, _, func = spec.partition(":")
    if not func:
        raise SystemExit(f"--model must look like package.module:function, not {spec!r}")
    return getattr(importlib.import_module(module_name), func)


def _mesh(spec: str):
    from autopart.mesh import Mesh

    device, _, shape = spec.partition(":")
    nodes, _, per_node = (shape or "1x1").partition("x")
    return Mesh.cluster(device, nodes=int(nodes), per_node=int(per_node or 1))


def cmd_plan(args: argparse.Namespace) -> int:
    import autopart

    factory = _factory(args.model)
    if args.meta:
        with torch.device("meta"):
            model, inputs = factory()
    else:
        model, inputs = factory()
    pins = {k: getattr(args, k) for k in _int_pins() if getattr(args, k) is not None}
    plan = autopart.plan(
        model, _mesh(args.mesh), inputs, precision=args.precision, schedule=args.schedule, **pins
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
        raise SystemExit(f"autopart report --html: {e}") from e
    print(path)
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from autopart import calibrate

    dtypes = args.dtypes.split(",") if args.dtypes else None
    if args.quick:
        calibrate.calibrate(
            args.out,
            dtypes=dtypes,
            name=args.name,
            sizes=calibrate.QUICK_SIZES,
            messages=calibrate.QUICK_MESSAGES,
            copy_bytes=calibrate.QUICK_COPY_BYTES,
        )
    else:
        calibrate.calibrate(args.out, dtypes=dtypes, name=args.name)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    import autopart
    from autopart.plan import Plan

    plan = Plan.load(args.plan)
    case = _factory(args.model)()
    if not isinstance(case, tuple) or len(case) != 5:
        raise SystemExit(
            "autopart verify: --model's factory must return (model, inputs, target, "
            f"loss_fn, optimizer), not {type(case).__name__}"
        )
    if args.world is not None and args.world != plan.degrees.world_size:
        raise SystemExit(
            f"autopart verify: --world {args.world} does not match the plan, made for "
            f"{plan.degrees.world_size} devices: verify runs a plan on a world of its own size"
        )
    model, inputs, target, loss_fn, optimizer = case
    report = autopart.verify(model, plan, inputs, target, loss_fn, optimizer, args.steps)
    print(report)
    return 0 if report.ok else 1


def main(argv: list[str] | None = None) -> int:
    # autopart's INFO log on stderr: what the solver priced and, in a solve longer than
    # a couple of seconds, how far it has got
    logging.basicConfig(format="%(message)s", stream=sys.stderr)
    logging.getLogger("autopart").setLevel(logging.INFO)
    parser = argparse.ArgumentParser(prog="autopart", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="plan a model for a mesh and print (and save) the plan")
    p.add_argument("--model", required=True, help="package.module:factory -> (model, inputs)")
    p.add_argument("--mesh", required=True, help="device:NODESxPER_NODE, e.g. h100-80g:8x8")
    p.add_argument("--meta", action="store_true", help="build the model on the meta device")
    p.add_argument("--precision", default="fp32", choices=PRECISIONS)
    p.add_argument("--schedule", choices=SCHEDULES)
    for name in _int_pins():
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int)
    p.add_argument("--out", help="write the plan JSON here")
    p.set_defaults(run=cmd_plan)

    r = sub.add_parser("report", help="print a saved plan and explain it, or draw it as HTML")
    r.add_argument("plan")
    r.add_argument("--html", metavar="DIR", help="write DIR/index.html with the plan's figures")
    r.set_defaults(run=cmd_report)

    v = sub.add_parser("verify", help="run a plan on local Gloo processes beside one device")
    v.add_argument("--model", required=True, help="package.module:factory -> a training case")
    v.add_argument("--plan", required=True, help="the plan JSON to check")
    v.add_argument("--world", type=int, help="processes (the plan's world size)")
    v.add_argument("--steps", type=int, default=3, help="training steps to compare")
    v.set_defaults(run=cmd_verify)

    c = sub.add_parser("calibrate", help="measure this machine into a device profile")
    c.add_argument("--out", required=True, help="where to write the device profile JSON")
    c.add_argument("--quick", action="store_true", help="few sizes: seconds, not minutes")
    c.add_argument("--name", help="the profile's device name")
    c.add_argument("--dtypes", help="comma-separated: fp32,bf16,fp16")
    c.set_defaults(run=cmd_calibrate)

    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
