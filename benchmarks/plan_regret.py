"""Whether the free plan runs fastest: the plan autopart chooses against its runners-up,
all measured, on zoo models and random models of the equivalence sweep.

    python benchmarks/plan_regret.py [--worlds 2,4] [--models gpt2,...] [--rounds 12]
                                     [--steps 1] [--alternatives 4] [--profiles DIR]

Per world (local Gloo processes on this host's CPUs):

    calibrates  `torchrun --nproc-per-node W autopart calibrate --quick`, as a user
                would, into a fresh profile (kept under `--profiles` when given);
    plans       every model on that profile, free: the chosen plan, then its
                runners-up, `plan.alternatives` first (those that differ from the
                chosen plan in what they switch on), then, while fewer than
                `--alternatives`, the fastest plan of each other factorization of the
                world, as `autopart.plan` prices it with those degrees pinned. Each
                runner-up is built from its pins (degrees, ZeRO stage, microbatches,
                schedule, sequence parallelism, offload), planned again, so that what
                runs is a plan autopart makes;
    measures    per model, every plan built side by side and warmed up, then `--rounds`
                rounds, each plan in turn (the order rotating from round to round, so
                the host's load hits all alike): one untimed step, then `--steps`
                steps, each after a barrier. A plan's time is the median of its steps;
                a step is as slow as the slowest rank. One world per model.

Prints one JSON line per model and world: each plan's predicted and measured step time,
the regret (the chosen plan's measured time over the fastest measured) and its value
in each round (the chosen plan's median over the fastest's: the spread), the Spearman
correlation of predicted and measured times over the plans, and whether the plan that
was predicted fastest (the choice would have been, without the "simplest within the
slack" rule) ran faster than the chosen one. Then a summary: regret per model, its
median and maximum against the targets (at most 1.10 on every model, median 1.0), and
the host's load average (1 minute) before and after each world.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from harness import print_json_line, spearman, world_step_seconds
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autopart  # noqa: E402
from autopart.degrees import Degrees  # noqa: E402
from autopart.plan import Alternative, Plan  # noqa: E402
from autopart.testing import run_world  # noqa: E402
from tests import random_models, zoo  # noqa: E402
from tests.models import lm_loss, make_optimizer, tiny_gpt2, tiny_llama, token_batch  # noqa: E402

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]
TARGETS = {"max_regret": 1.10, "median_regret": 1.0}
WARMUP_STEPS = 2


@dataclass(frozen=True)
class Model:
    """A model to plan and run: seeded, so every rank builds the same weights."""

    build: Callable[[], nn.Module]
    batch: Callable[[], Batch]
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    source: str  # where it comes from: the zoo, or the equivalence sweep's random models

    def model(self) -> nn.Module:
        torch.manual_seed(0)
        return self.build()


def _zoo(name: str) -> Model:
    case = zoo.MODELS[name]
    return Model(case.build, case.batch, case.loss_fn, "zoo")


def _lm_batch(batch: int, seq: int) -> Batch:
    ids, target = token_batch(batch, seq)
    return (ids,), target


def _random_lm(width: int, vocab: int, blocks: tuple[str, ...], seq: int) -> nn.Module:
    return random_models.RandomLM(random_models.Case(width, vocab, blocks, False, (), 0, seq))


def _random_batch(vocab: int, batch: int, seq: int) -> Batch:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return (ids,), torch.randint(0, vocab, (batch, seq), generator=g)


def _random(width: int, vocab: int, blocks: tuple[str, ...], batch: int, seq: int) -> Model:
    """A random model of the equivalence sweep (`tests/random_models.py`), drawn by hand
    at sizes where each axis can win: its blocks, of one width, between an embedding
    and a head over `vocab` tokens; a batch of `batch` sequences of `seq` tokens."""
    return Model(
        functools.partial(_random_lm, width, vocab, blocks, seq),
        functools.partial(_random_batch, vocab, batch, seq),
        random_models.loss,
        "random",
    )


# The zoo's decoders, an encoder and a mixture of experts at the zoo's batch (8 × 16);
# tiny GPT-2 on longer sequences, two per batch; tiny Llama on one sequence of 1024
# tokens (tp on 2 ranks, cp × tp on 4); random models with a large vocabulary, with
# wide layers and a small batch (pp), and attention between MLPs.
MODELS: dict[str, Model] = {
    "gpt2": _zoo("gpt2"),
    "llama": _zoo("llama"),
    "bert": _zoo("bert"),
    "mixtral": _zoo("mixtral"),
    "gpt2_seq64": Model(tiny_gpt2, functools.partial(_lm_batch, 2, 64), lm_loss, "zoo"),
    "llama_seq1024": Model(
        functools.partial(tiny_llama, positions=1024),
        functools.partial(_lm_batch, 1, 1024),
        lm_loss,
        "zoo",
    ),
    "random_vocab": _random(64, 8192, ("mlp",) * 4, 4, 16),
    "random_wide": _random(512, 128, ("mlp",) * 8, 8, 4),
    "random_attention": _random(128, 4096, ("attention", "mlp") * 2, 4, 16),
}


# -- in the launching process: calibrate and plan -----------------------------------


def calibrated_profile(world: int, directory: Path) -> Path:
    """A fresh profile of this host at `world` ranks, measured by the command line as a
    user runs it (`autopart calibrate --quick` under torchrun)."""
    path = directory / f"cpu-world{world}.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={world}",
        shutil.which("autopart") or str(Path(sys.executable).parent / "autopart"),
        "calibrate",
        "--quick",
        f"--out={path}",
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"calibration at world {world} failed:\n{done.stderr[-4000:]}")
    return path


@dataclass(frozen=True)
class Candidate:
    """One plan of a model to measure: its label (what it switches on) and its file."""

    label: str
    path: str
    predicted_s: float
    chosen: bool


def plans_of(name: str, mesh: autopart.Mesh, count: int, directory: Path) -> list[Candidate]:
    """The free plan of model `name` on `mesh`, then up to `count` runners-up (module
    docstring), each saved under `directory`."""
    spec = MODELS[name]
    free = _plan(spec, mesh, {})
    assert free is not None, f"{name}: no free plan"
    plans, labels = [free], {label_of(free)}
    for pins in _runner_up_pins(free, mesh.world_size):
        if len(plans) > count:
            break
        plan = _plan(spec, mesh, pins)
        if plan is not None and label_of(plan) not in labels:
            plans.append(plan)
            labels.add(label_of(plan))
    out = []
    for i, plan in enumerate(plans):
        path = directory / f"{name}-w{mesh.world_size}-{i}.json"
        plan.save(path)
        assert plan.predicted is not None
        out.append(Candidate(label_of(plan), str(path), plan.predicted.step_time_s, i == 0))
    return out


def _plan(spec: Model, mesh: autopart.Mesh, pins: dict[str, Any]) -> Plan | None:
    """`autopart.plan` of the model under `pins`; None where autopart refuses them."""
    inputs, _ = spec.batch()
    try:
        return autopart.plan(spec.model(), mesh, inputs, loss_fn=spec.loss_fn, **pins)
    except ValueError:  # PlanError, NoPlanFits: the pins leave no plan
        return None


def _runner_up_pins(free: Plan, world: int) -> Iterable[dict[str, Any]]:
    """The pins of the free plan's alternatives, then of every other factorization."""
    for alternative in free.alternatives:
        yield pins_of(alternative)
    listed = {free.degrees, *(a.degrees for a in free.alternatives)}
    for degrees in Degrees.factorizations(world):
        if degrees not in listed:
            yield _degree_pins(degrees)


def _degree_pins(degrees: Degrees) -> dict[str, int]:
    return {str(axis): n for axis, n in degrees.items()}


def pins_of(a: Alternative | Plan) -> dict[str, Any]:
    """What an alternative switches on, as pins; its stage cuts and recomputed blocks
    are left to the solver, which fits them as it did when it ranked it."""
    pins: dict[str, Any] = {**_degree_pins(a.degrees), "zero": a.zero, "offload": a.offload}
    pins["microbatches"] = a.microbatches
    if a.degrees["pp"] > 1:
        pins |= {"schedule": a.schedule, "virtual_stages": a.virtual_stages}
    if a.degrees["tp"] > 1:
        pins["sequence_parallel"] = a.sequence_parallel
    return pins


def label_of(p: Plan) -> str:
    """What a plan switches on, in a few words: `dp2 tp2 zero1 m2 1f1b`."""
    words = [f"{axis}{n}" for axis, n in p.degrees.items() if n > 1] or ["single"]
    words += [f"zero{p.zero}"] if p.zero else []
    words += [f"m{p.microbatches}"] if p.microbatches > 1 else []
    words += [p.schedule] if p.schedule and p.degrees["pp"] > 1 else []
    words += [f"v{p.virtual_stages}"] if p.virtual_stages > 1 else []
    words += ["sp"] if p.sequence_parallel else []
    words += ["shards-nothing"] if p.tp_shards_nothing else []
    words += [f"recompute{len(p.recompute)}"] if p.recompute else []
    words += ["offload"] if p.offload else []
    return " ".join(words)


# -- on every rank: build and time ----------------------------------------------------


def measure_model(
    name: str, paths: list[str], profile: str, options: dict[str, int]
) -> dict[str, Any]:
    """On every rank: the step times of model `name`'s plans (each plan's median
    seconds on this rank), and why a plan did not run."""
    return _measure_model(name, paths, autopart.Mesh.local(device=profile), options)


def _measure_model(
    name: str, paths: list[str], mesh: autopart.Mesh, options: dict[str, int]
) -> dict[str, Any]:
    spec = MODELS[name]
    inputs, target = spec.batch()
    steps: dict[str, Callable[[], object]] = {}
    failed: dict[str, str] = {}
    programs = []
    for path in paths:
        try:
            pm = autopart.parallelize(
                spec.model(),
                mesh,
                inputs,
                loss_fn=spec.loss_fn,
                optimizer=make_optimizer("adamw"),
                plan=Plan.load(path),
            )
        except Exception as e:  # a plan the solver offered must build: report it
            failed[path] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            continue
        programs.append(pm)
        steps[path] = functools.partial(pm.train_step, inputs, target)
    times = _interleaved_times(steps, options["rounds"], options["steps"])
    for pm in programs:
        pm.close()
    dist.barrier()
    return {"model": name, "times": times, "failed": failed}


def _interleaved_times(
    steps: dict[str, Callable[[], object]], rounds: int, count: int
) -> dict[str, list[list[float]]]:
    """Each plan's step times, per round: `rounds` rounds of `count` steps, the plans
    taking turns within a round, and the first to go rotating from round to round.
    Each turn starts with an untimed step: the plans before it have evicted this one's
    parameters and activations from the caches, which a training loop keeps."""
    for step in steps.values():
        for _ in range(WARMUP_STEPS):
            step()
    keys = list(steps)
    samples: dict[str, list[list[float]]] = {key: [] for key in keys}
    for r in range(rounds):
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            steps[key]()
            samples[key].append([world_step_seconds(steps[key]) for _ in range(count)])
    return samples


# -- the report ------------------------------------------------------------------------


def model_line(
    name: str, world: int, candidates: list[Candidate], per_rank: list[dict[str, Any]]
) -> dict[str, Any]:
    """One model's JSON line from its plans and every rank's times of them."""
    failures = per_rank[0]["failed"]  # a plan fails to build on every rank alike
    failed = {c.label: failures[c.path] for c in candidates if c.path in failures}
    ran = [c for c in candidates if c.path not in failures]
    measured = {c.path: _slowest_rank(per_rank, c.path, _every_step) for c in ran}
    chosen = next(c for c in candidates if c.chosen)
    fastest = min(ran, key=lambda c: measured[c.path])
    predicted_fastest = min(ran, key=lambda c: c.predicted_s)
    line: dict[str, Any] = {
        "benchmark": "plan_regret",
        "model": name,
        "source": MODELS[name].source,
        "world": world,
        "chosen": chosen.label,
        "plans": [
            {
                "plan": c.label,
                "predicted_s": round(c.predicted_s, 5),
                "measured_s": round(measured[c.path], 5),
            }
            for c in ran
        ],
        "failed": failed,
    }
    if chosen.path not in measured:
        return line | {"regret": None}
    return line | {
        "fastest_measured": fastest.label,
        "regret": round(measured[chosen.path] / measured[fastest.path], 3),
        "regret_per_round": _per_round(per_rank, chosen.path, fastest.path),
        "spearman": round(
            spearman([c.predicted_s for c in ran], [measured[c.path] for c in ran]), 3
        ),
        "predicted_fastest": predicted_fastest.label,
        "predicted_fastest_over_chosen": round(
            measured[predicted_fastest.path] / measured[chosen.path], 3
        ),
    }


def _every_step(rounds: list[list[float]]) -> float:
    return statistics.median(t for steps in rounds for t in steps)


def _slowest_rank(
    per_rank: list[dict[str, Any]], path: str, of: Callable[[list[list[float]]], float]
) -> float:
    """`of` a plan's step times, on the rank where it is the largest: a step is as slow
    as its slowest rank."""
    return max(of(r["times"][path]) for r in per_rank)


def _per_round(per_rank: list[dict[str, Any]], chosen: str, fastest: str) -> list[float]:
    """The chosen plan's median step over the fastest's, round by round: the spread."""
    rounds = len(per_rank[0]["times"][chosen])
    in_round = [functools.partial(_round_median, i) for i in range(rounds)]
    return [
        round(_slowest_rank(per_rank, chosen, f) / _slowest_rank(per_rank, fastest, f), 3)
        for f in in_round
    ]


def _round_median(i: int, rounds: list[list[float]]) -> float:
    return statistics.median(rounds[i])


def summary(lines: list[dict[str, Any]], loads: dict[int, tuple[float, float]]) -> dict:
    regrets = [line["regret"] for line in lines if line["regret"] is not None]
    return {
        "benchmark": "plan_regret",
        "results": len(lines),
        "regret": {f"{line['model']}/w{line['world']}": line["regret"] for line in lines},
        "median_regret": round(statistics.median(regrets), 3) if regrets else None,
        "max_regret": max(regrets, default=None),
        "within_target": sum(r <= TARGETS["max_regret"] for r in regrets),
        "median_spearman": round(
            statistics.median(line["spearman"] for line in lines if "spearman" in line), 3
        )
        if regrets
        else None,
        "failed_plans": sum(len(line["failed"]) for line in lines),
        "targets": TARGETS,
        "load_average_before_after": {f"world{w}": load for w, load in loads.items()},
    }


def run(world: int, names: list[str], args: argparse.Namespace, directory: Path) -> list[dict]:
    """Calibrate, then plan and measure every model in a world of `world` ranks."""
    profile = calibrated_profile(world, directory)
    return plan_and_measure(world, names, str(profile), args, directory)


def plan_and_measure(
    world: int, names: list[str], profile: str, args: argparse.Namespace, directory: Path
) -> list[dict]:
    """Plan every model on `profile` (a device profile or preset) and measure its plans
    in a world of `world` ranks; print and return the models' lines."""
    mesh = autopart.Mesh.cluster(profile, nodes=1, per_node=world)
    options = {"rounds": args.rounds, "steps": args.steps}
    lines = []
    for name in names:  # a world per model: each stays well within run_world's limit
        candidates = plans_of(name, mesh, args.alternatives, directory)
        paths = [c.path for c in candidates]
        per_rank = run_world(measure_model, world, name, paths, profile, options)
        lines.append(model_line(name, world, candidates, per_rank))
        print_json_line(lines[-1])
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rounds", type=int, default=12, help="turns each plan takes")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per turn")
    parser.add_argument("--alternatives", type=int, default=4, help="runners-up per model")
    parser.add_argument("--profiles", help="where to keep the profiles and plans (a temp dir)")
    args = parser.parse_args()
    names = args.models.split(",")
    lines, loads = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(args.profiles or tmp)
        directory.mkdir(parents=True, exist_ok=True)
        for world in (int(w) for w in args.worlds.split(",")):
            before = os.getloadavg()[0]
            lines += run(world, names, args, directory)
            loads[world] = (round(before, 2), round(os.getloadavg()[0], 2))
    print_json_line(summary(lines, loads))


if __name__ == "__main__":
    main()
