"""The shared plumbing of the multi-process numerics tests: train a tiny language model
on every rank of a world started by `autopart.testing.run_world`, then check each rank
against the same model trained on one device (`tests.models.train_single_device`)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

import autopart
from autopart.api import captured_for_planning
from autopart.mesh import DeviceSpec, device_spec
from autopart.ops.loss_match import match_cross_entropy
from autopart.plan import Plan
from autopart.solver import Pins, make_plan
from tests.models import assert_matches, lm_loss, make_optimizer

Batch = tuple[torch.Tensor, torch.Tensor]


def slow_links_cpu() -> DeviceSpec:
    """The CPU preset with links slow enough (1 ms, 20 MB/s) that a tiny model's
    gradient all-reduce costs more than half its step: every rank running the whole
    step, with no collective, is then priced faster than splitting the batch."""
    cpu = device_spec("cpu")
    return replace(cpu, intra_node_latency=1e-3, intra_node_bandwidth=2e7, collectives={})


def parallelize_lm(
    model: nn.Module,
    batch: Batch,
    optimizer: str = "adamw",
    device: DeviceSpec | None = None,
    **pins: Any,
) -> autopart.ParallelModule:
    """`model` parallelized over the running world (its devices priced as `device`, the
    local preset where None) for training on `batch` with the language-model loss. Runs
    on every rank; `pins` go to `autopart.parallelize`."""
    ids, _ = batch
    return autopart.parallelize(
        model,
        autopart.Mesh.local(device=device),
        (ids,),
        loss_fn=lm_loss,
        optimizer=make_optimizer(optimizer),
        **pins,
    )


def plan_lm(model: nn.Module, ids: torch.Tensor, mesh: autopart.Mesh, **pins: Any) -> Plan:
    """The plan for a language model trained in bf16 mixed precision with the
    language-model loss on logits sharded over the vocabulary, as
    `benchmarks/plan_speed.py` plans it, from the shortened capture (a model and `ids`
    on the meta device plan without a world)."""
    captured = captured_for_planning(model, (ids,), repeated_once=True)
    loss = match_cross_entropy(lm_loss, captured.gm)
    assert loss is not None, "the language-model loss is a standard cross-entropy"
    pins = {"precision": "bf16-mixed", **pins}
    return make_plan(captured, mesh, Pins.of(sharded_logits=loss.logits, **pins))


def train_losses(pm: autopart.ParallelModule, batch: Batch, steps: int) -> list[float]:
    """The global loss of each of `steps` training steps on the whole `batch`."""
    ids, target = batch
    return [pm.train_step(ids, target).item() for _ in range(steps)]


def train_case(
    model: nn.Module,
    batch: Batch,
    steps: int,
    optimizer: str = "adamw",
    inspect: Callable[[autopart.ParallelModule], dict[str, Any]] | None = None,
    device: DeviceSpec | None = None,
    **pins: Any,
) -> dict[str, Any]:
    """Train one case on every rank: {"losses", "params"}, the form `assert_matches`
    compares, with the parameters whole (gathered from every rank's pieces). `inspect`
    adds a test's own measurements of the trained module; it runs on every rank before
    the module is closed, since some of what it reads (collectives, the gathered
    `full_state_dict`) needs all ranks or the live module. `device`: as
    `parallelize_lm`'s."""
    pm = parallelize_lm(model, batch, optimizer, device, **pins)
    result = {"losses": train_losses(pm, batch, steps), "params": pm.full_state_dict()}
    if inspect is not None:
        result.update(inspect(pm))
    pm.close()
    return result


def case_key(model_name: str, pins: Mapping[str, Any]) -> tuple:
    """A hashable, order-independent name for a (model, pins) case, to key results by."""
    return model_name, tuple(sorted(pins.items()))


def assert_every_rank_matches(
    per_rank: list[dict], key: Hashable, reference: dict[str, Any], label: object = None
) -> None:
    """Every rank's result under `key` matches the single-device `reference`
    (`assert_matches`'s tolerances). A failure names the case (`label`, else `key`) and
    the rank, since one run holds several cases and a layout bug may hit one rank only."""
    for rank, results in enumerate(per_rank):
        try:
            assert_matches(results[key], reference)
        except AssertionError as e:
            name = key if label is None else label
            raise AssertionError(f"{name}: rank {rank} of {len(per_rank)}: {e}") from e
