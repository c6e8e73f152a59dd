"""What the side-by-side benchmarks share: the tiny Llama models and their batch, a local
Gloo world per comparison, autopart and its PyTorch-native baseline timed against each
other in alternating rounds, and the one JSON line each benchmark prints.

A comparison script keeps only what is its own: the model's sizes, autopart's pins, the
native baseline and its command-line defaults. For instance:

    def _bench(args):  # on every rank
        return time_against_native(args, build_model, sgd, ddp_baseline, dp=args.world)

    args = comparison_options(__doc__, steps=30, rounds=3, batch=8, seq=64).parse_args()
    run_comparison(_bench, args, "dp_vs_ddp", target_ratio=1.05)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import autopart
from autopart.api import captured_for_planning
from autopart.ops.loss_match import match_cross_entropy
from autopart.testing import run_world

T = TypeVar("T")
Step = Callable[[], float]  # one training step on this rank; returns its loss as this rank sees it
# Builds the native baseline's step on this rank, given autopart's program (whose plan
# it may follow) and the batch both train on.
NativeBaseline = Callable[[autopart.ParallelModule, torch.Tensor, torch.Tensor], Step]


# -- the models and their batch -------------------------------------------------------


def llama(
    *,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    positions: int,
) -> LlamaForCausalLM:
    """A Llama-style causal LM of these sizes. The seed is fixed, so every copy a
    benchmark builds (autopart's and the baseline's) starts from the same weights."""
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=positions,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return LlamaForCausalLM(config)


def gpt(hidden: int, layers: int, heads: int, vocab: int = 51200) -> Callable[[], nn.Module]:
    """A builder of a GPT-2-style causal LM of these sizes (sequence 2048; Megatron-LM's
    padded GPT-2 vocabulary by default), for the planning benchmarks' published shapes."""
    config = GPT2Config(
        n_layer=layers,
        n_embd=hidden,
        n_head=heads,
        n_positions=2048,
        vocab_size=vocab,
        use_cache=False,
    )
    return lambda: GPT2LMHeadModel(config)


def captured_on_meta(build: Callable[[], nn.Module], batch: int, seq: int) -> tuple[Any, float]:
    """The model `build` makes, on the meta device, captured and analyzed as
    `autopart.plan` does, at a batch of `batch` sequences of `seq` tokens; and the
    seconds that took."""
    with torch.device("meta"):
        model = build()
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")

    return timed(lambda: captured_for_planning(model, (ids,), repeated_once=True))


def bare_export_s(build: Callable[[], nn.Module], batch: int, seq: int) -> float:
    """Seconds torch.export takes to capture the model `build` makes on the meta device,
    at `batch` sequences of `seq` tokens, with nothing of autopart's around it: what
    planning is measured against."""
    with torch.device("meta"):
        model = build()
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return timed(lambda: torch.export.export(model, (ids,), strict=False))[1]


def warm_up_export() -> None:
    """torch.export's first call in a process pays for what it sets up once (imports,
    dispatch caches): paid here, on a tiny model, so that neither the first plan's
    capture nor the first bare export carries it."""
    bare_export_s(gpt(64, 1, 4, vocab=128), 2, 16)


# Llama-3-8B's shape, for `llama(**LLAMA3_8B, positions=...)`.
LLAMA3_8B = dict(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=128256)


def lm_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of a Hugging Face causal LM's output."""
    return F.cross_entropy(output.logits.flatten(0, 1), target.flatten())


def lm_loss_pins(captured: Any) -> dict[str, Any]:
    """The pins that tell the planner training runs `lm_loss` on `captured`: a standard
    cross-entropy the runtime computes on logits sharded over the vocabulary, as every
    published large run does (Megatron-LM's vocabulary-parallel cross-entropy)."""
    loss = match_cross_entropy(lm_loss, captured.gm)
    return {"sharded_logits": loss.logits} if loss is not None else {}


def token_batch(batch: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and targets, the same on every rank (its own seeded generator)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return ids, torch.randint(0, vocab, (batch, seq), generator=g)


def sgd(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """What the DP, TP and PP comparisons train with on both sides: plain SGD, so that
    the step compared is the parallelism's, not an optimizer's."""
    return torch.optim.SGD(params, lr=1e-3)


# -- on every rank ---------------------------------------------------------------------


def time_against_native(
    args: argparse.Namespace,
    build_model: Callable[[], LlamaForCausalLM],
    optimizer: Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer],
    native_baseline: NativeBaseline,
    **pins: Any,
) -> dict[str, Any]:
    """autopart's program of `build_model()` under `pins` against `native_baseline`, both
    training on the global batch of `args.batch` × `args.seq` (see `compare`)."""
    model = build_model()
    ids, target = token_batch(args.batch, args.seq, model.config.vocab_size)
    pm = autopart.parallelize(
        model, autopart.Mesh.local(), (ids,), loss_fn=lm_loss, optimizer=optimizer, **pins
    )

    def autopart_step() -> float:
        return pm.train_step(ids, target).item()

    result = compare(autopart_step, native_baseline(pm, ids, target), args.steps, args.rounds)
    pm.close()
    return result


def this_ranks_rows(batch: int) -> slice:
    """This rank's share of a global batch split evenly over the world, as data
    parallelism splits it."""
    world, rank = dist.get_world_size(), dist.get_rank()
    return slice(rank * batch // world, (rank + 1) * batch // world)


def global_mean_loss(loss: torch.Tensor) -> float:
    """The mean of every rank's loss on its share: the global batch's loss, as autopart's
    step returns it, so that the first losses of both sides can be compared."""
    mean = loss.detach() / dist.get_world_size()
    dist.all_reduce(mean)
    return mean.item()


def compare(autopart_step: Step, native_step: Step, steps: int, rounds: int) -> dict[str, Any]:
    """Warm both up (their first losses, from the same weights and batch, should agree),
    then time them against each other: each one's median seconds per step over `steps`
    steps, run in `rounds` alternating runs so that drift in machine load hits both alike."""
    first = {"autopart": autopart_step(), "native": native_step()}
    autopart_step()
    native_step()
    times: dict[str, list[float]] = {"autopart": [], "native": []}
    per_round: dict[str, list[float]] = {"autopart": [], "native": []}
    for _ in range(rounds):
        for name, step in (("autopart", autopart_step), ("native", native_step)):
            run = [world_step_seconds(step) for _ in range(steps // rounds)]
            times[name] += run
            per_round[name].append(statistics.median(run))
    medians = {name: statistics.median(t) for name, t in times.items()}
    return medians | {"first": first, "rounds": per_round}


def world_step_seconds(step: Callable[[], object]) -> float:
    """Seconds of one step. It starts after a barrier, so it times the whole world's step."""
    dist.barrier()
    return timed(step)[1]


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """`fn()`'s result and the seconds it took."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


# -- in the launching process ----------------------------------------------------------


def comparison_options(
    doc: str, *, steps: int, rounds: int, batch: int, seq: int
) -> argparse.ArgumentParser:
    """The options every comparison takes, with the script's defaults; the first line of
    its docstring `doc` describes it."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--seq", type=int, default=seq)
    return parser


def run_comparison(
    bench: Callable[[argparse.Namespace], dict[str, Any]],
    args: argparse.Namespace,
    benchmark: str,
    target_ratio: float,
    *,
    settings: Sequence[str] = ("world", "batch", "seq"),
    loss_rank: int = 0,
    extra_fields: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None,
    loss_rtol: float = 1e-5,
) -> None:
    """Run `bench(args)` (which returns `compare`'s result) on every rank of a local Gloo
    world of `args.world` processes and print the comparison's JSON line: `benchmark`,
    the `settings` of `args`, each median (a step is as slow as its slowest rank),
    autopart / native and its value in each round (the spread), the target ratio, and
    both first losses as `loss_rank` saw them; fail if those differ by more than
    `loss_rtol` (relative). `extra_fields`,
    given every rank's result, adds a script's own fields at the end of the line."""
    per_rank = run_world(bench, args.world, args)
    autopart_s = max(r["autopart"] for r in per_rank)
    native_s = max(r["native"] for r in per_rank)
    first = per_rank[loss_rank]["first"]
    # Each round's ratio (a round's step is as slow as its slowest rank): the spread.
    rounds = zip(*(zip(r["rounds"]["autopart"], r["rounds"]["native"]) for r in per_rank))
    ratios = [max(a for a, _ in ranks) / max(n for _, n in ranks) for ranks in rounds]
    print_json_line(
        {
            "benchmark": benchmark,
            **{name: getattr(args, name) for name in settings},
            **median_fields(autopart_s, native_s),
            "ratio_per_round": [round(r, 3) for r in ratios],
            "target_ratio": target_ratio,
            "first_loss_autopart": round(first["autopart"], 6),
            "first_loss_native": round(first["native"], 6),
            **(extra_fields(per_rank) if extra_fields else {}),
        }
    )
    if abs(first["autopart"] - first["native"]) > loss_rtol * abs(first["native"]):
        raise SystemExit(
            f"{benchmark}: the first losses differ ({first['autopart']} vs {first['native']}):"
            " the two sides do not train the same model, so their times do not compare"
        )


def median_fields(
    autopart_s: float, baseline_s: float, baseline: str = "native"
) -> dict[str, float]:
    """The JSON fields of two median step times and their ratio, autopart / baseline."""
    return {
        "autopart_median_s": round(autopart_s, 5),
        f"{baseline}_median_s": round(baseline_s, 5),
        "ratio": round(autopart_s / baseline_s, 3),
    }


def print_json_line(record: dict[str, Any]) -> None:
    """Print `record` as one JSON line, flushed at once: a benchmark that prints several
    (cost_model_fidelity.py) shows each as it comes even when its output is piped."""
    print(json.dumps(record), flush=True)


def megatron_pins(tp: int, pp: int, v: int = 1, recompute: bool | None = True) -> dict[str, Any]:
    """Megatron-LM's runs as pins: tp × pp, no ZeRO, no sequence parallelism (which came
    after these runs, or was not used in them), 1F1B or interleaved over `v` chunks;
    every block recomputed (None: left to autopart)."""
    pins: dict[str, Any] = dict(tp=tp, pp=pp, zero=0, sequence_parallel=False)
    if recompute is not None:
        pins["recompute"] = recompute
    if pp > 1:
        pins["schedule"] = "interleaved-1f1b" if v > 1 else "1f1b"
        pins["virtual_stages"] = v if v > 1 else None
    return pins


def pinned_as_published(
    pins: dict[str, Any], gpus: int, batch: int, microbatch_size: int | None, precision: str
) -> dict[str, Any]:
    """A published run's parallel configuration as autopart's pins: its tp and pp, the
    dp that fills the rest of the `gpus`, its microbatch count where its size is known."""
    out = dict(pins, precision=precision)
    dp = gpus // (out.get("tp", 1) * out.get("pp", 1))
    out["dp"] = dp
    if microbatch_size:
        out["microbatches"] = batch // dp // microbatch_size
    return out


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks (ties share their
    mean rank)."""
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / var if var else 0.0


def _ranks(values: Sequence[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks
