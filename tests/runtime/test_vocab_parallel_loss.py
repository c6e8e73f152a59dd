"""A vocabulary-parallel head with a parallel cross-entropy: where the loss is a standard
cross-entropy and the plan shards the head over the vocabulary, the logits stay sharded
and no rank holds them whole; any other loss gathers them. Both train as one device
does (1e-5 relative), with SGD (which shows a gradient scaled wrong) and AdamW."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import autopart
from autopart.api import captured_for_planning
from autopart.ops.loss_match import CrossEntropy, match_cross_entropy
from autopart.testing import run_world
from tests.harness import train_losses
from tests.models import (
    VOCAB,
    FixedLengthLM,
    assert_matches,
    lm_loss,
    make_optimizer,
    tiny_gpt2,
    tiny_llama,
    token_batch,
    train_reference,
)

STEPS = 3
BATCH = token_batch(batch=8)
# The tables that read or write the vocabulary, by model, pinned to shard over it (and
# Llama's final norm whole: the solver shards it with a row-parallel head, which a
# vocabulary-parallel head would have to gather).
VOCAB_LAYOUT = {
    "llama": {
        "model.embed_tokens.weight": Shard(0),
        "lm_head.weight": Shard(0),
        "model.norm.weight": Replicate(),
    },
    "gpt2": {"transformer.wte.weight": Shard(0)},  # tied with the head
}
FACTORIES = {"llama": tiny_llama, "gpt2": tiny_gpt2}


def smoothed_loss(output, target: torch.Tensor) -> torch.Tensor:
    """Not a standard cross-entropy: label smoothing reads every logit."""
    return F.cross_entropy(output.logits.flatten(0, 1), target.flatten(), label_smoothing=0.1)


def ignoring_loss(output, target: torch.Tensor) -> torch.Tensor:
    """A standard cross-entropy that skips the tokens whose target is 7."""
    return F.cross_entropy(output.logits.flatten(0, 1), target.flatten(), ignore_index=7)


_MODULE_LOSS = nn.CrossEntropyLoss()


# -- recognizing the loss ----------------------------------------------------------------


@functools.cache
def _llama_graph():
    return captured_for_planning(tiny_llama(), (BATCH[0],)).gm


STANDARD = {
    "flatten": lm_loss,
    "view": lambda o, t: F.cross_entropy(o.logits.view(-1, VOCAB), t.view(-1)),
    "module": lambda o, t: _MODULE_LOSS(o.logits.reshape(-1, o.logits.size(-1)), t.reshape(-1)),
    "index": lambda o, t: F.cross_entropy(o[0].flatten(0, 1), t.flatten()),
    "key-float": lambda o, t: F.cross_entropy(o["logits"].float().flatten(0, 1), t.flatten()),
}
OTHER = {
    "smoothing": smoothed_loss,
    "sum": lambda o, t: F.cross_entropy(o.logits.flatten(0, 1), t.flatten(), reduction="sum"),
    "weights": lambda o, t: F.cross_entropy(
        o.logits.flatten(0, 1), t.flatten(), weight=torch.ones(VOCAB)
    ),
    "extra-term": lambda o, t: lm_loss(o, t) + 1e-3 * o.logits.pow(2).mean(),
    "shifted": lambda o, t: F.cross_entropy(o.logits[:, :-1].flatten(0, 1), t[:, 1:].flatten()),
    "classes-in-dim-1": lambda o, t: F.cross_entropy(o.logits.transpose(1, 2), t),
    "mse": lambda o, t: F.mse_loss(o.logits, torch.zeros_like(o.logits)),
    "dict-target": lambda o, t: F.cross_entropy(o.logits.flatten(0, 1), t["labels"].flatten()),
    "not-traceable": lambda o, t: lm_loss(o, t) * float(o.logits.sum()),
}


@pytest.mark.parametrize("name", sorted(STANDARD))
def test_standard_cross_entropy_is_recognized_however_spelled(name):
    assert match_cross_entropy(STANDARD[name], _llama_graph()) == CrossEntropy(logits=0)


def test_ignore_index_is_read_from_the_loss():
    assert match_cross_entropy(ignoring_loss, _llama_graph()) == CrossEntropy(0, ignore_index=7)


@pytest.mark.parametrize("name", sorted(OTHER))
def test_any_other_loss_is_not_recognized(name):
    assert match_cross_entropy(OTHER[name], _llama_graph()) is None


def test_a_model_returning_a_tensor_is_recognized():
    gm = captured_for_planning(FixedLengthLM(), (BATCH[0],)).gm
    assert match_cross_entropy(lm_loss, gm) == CrossEntropy(logits=0)


# -- the parallel cross-entropy itself ---------------------------------------------------


def _parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> dict:
    """Each rank's loss and the gradient of its slice of `logits`."""
    import torch.distributed as dist

    from autopart.ops.vocab_parallel_loss import vocab_parallel_cross_entropy

    rank, size = dist.get_rank(), dist.get_world_size()
    local = logits.chunk(size, -1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, dist.group.WORLD, ignore_index=-100)
    (loss * 3).backward()
    return {"loss": loss.detach(), "grad": local.grad}


def test_parallel_cross_entropy_matches_the_whole_one():
    """Values and gradients, with large logits (the max must be taken out) and ignored
    tokens (left out of the mean)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 6, 32, generator=g) * 30
    target = torch.randint(0, 32, (4, 6), generator=g)
    target[0, :3] = -100
    whole = logits.clone().requires_grad_()
    want = F.cross_entropy(whole.flatten(0, 1), target.flatten())
    (want * 3).backward()
    assert whole.grad is not None
    for rank, got in enumerate(run_world(_parallel_cross_entropy, 2, logits, target)):
        torch.testing.assert_close(got["loss"], want.detach(), rtol=1e-6, atol=0)
        torch.testing.assert_close(got["grad"], whole.grad.chunk(2, -1)[rank], rtol=1e-5, atol=1e-7)


# -- training ----------------------------------------------------------------------------


def _vocabulary_plan(model_name: str, pins: dict) -> autopart.Plan:
    """The solver's plan with the vocabulary tables pinned to shard over the vocabulary."""
    plan = autopart.plan(FACTORIES[model_name](), autopart.Mesh.local(), (BATCH[0],), **pins)
    placements = dict(plan.placements)
    for fqn, place in VOCAB_LAYOUT[model_name].items():
        placements[fqn] = (placements[fqn][0], place)
    return plan.with_changes(placements=placements)


def _loss_inputs(pm: autopart.ParallelModule) -> dict:
    """Whether the program's logits are left sharded for a parallel loss, and the
    collectives it runs; without a pipeline also the width of the logits the program
    returns and of those `pm(...)` gives back."""
    gathers = [n for n, info in pm.collectives() if info.kind == "all_gather"]
    found = {"parallel_loss": pm.vocab_parallel_loss is not None, "gathers": gathers}
    if pm.plan.pp == 1:
        ids, target = pm.local_batch(BATCH)
        output = pm.graph(ids)
        found["program_width"] = output.logits.shape[-1]
        found["forward_width"] = pm(ids).logits.shape[-1]
        # A target the loss was not recognized for (flat) gathers the logits instead.
        assert pm.executor is not None
        step_loss = pm.executor.loss_fn
        by_slices, gathered = step_loss(output, target), step_loss(output, target.flatten())
        found["flat_target_gap"] = ((by_slices - gathered).abs() / gathered).item()
    return found


def _train_cases(cases: list[tuple[str, str, str, dict]]) -> dict:
    """Each case (model, optimizer, loss, pins) trained under its vocabulary plan; with
    the widths of the logits each vocabulary-parallel loss was computed from."""
    from autopart.runtime import loss as runtime_loss

    widths: list[int] = []
    parallel = runtime_loss.vocab_parallel_cross_entropy

    def recording(logits, *args, **kwargs):
        widths.append(logits.shape[-1])
        return parallel(logits, *args, **kwargs)

    runtime_loss.vocab_parallel_cross_entropy = recording  # type: ignore[assignment]
    results = {}
    for model_name, optimizer, loss_name, pins in cases:
        widths.clear()
        pm = autopart.parallelize(
            FACTORIES[model_name](),
            autopart.Mesh.local(),
            (BATCH[0],),
            loss_fn=LOSSES[loss_name],
            optimizer=make_optimizer(optimizer),
            plan=_vocabulary_plan(model_name, pins),
        )
        result = {"losses": train_losses(pm, BATCH, STEPS), "params": pm.full_state_dict()}
        result.update(_loss_inputs(pm), loss_widths=set(widths))
        pm.close()
        results[_key(model_name, optimizer, loss_name, pins)] = result
    return results


def _key(model_name: str, optimizer: str, loss_name: str, pins: dict) -> tuple:
    return model_name, optimizer, loss_name, tuple(sorted(pins.items()))


LOSSES = {"standard": lm_loss, "smoothed": smoothed_loss, "ignoring": ignoring_loss}
# The quick suite runs the standard loss; the slow sweeps the gathered and ignoring ones.
TP2 = {
    "quick": [("llama", "sgd", "standard", {"tp": 2})],
    "more": [
        ("llama", "sgd", "smoothed", {"tp": 2}),
        # One microbatch: a mean over the tokens not ignored is taken per microbatch (and per
        # data-parallel rank), then averaged, which equals one device's only for even counts.
        ("llama", "adamw", "ignoring", {"tp": 2, "microbatches": 1}),
    ],
}


@functools.cache
def _tp2(cases: str) -> dict:
    return run_world(_train_cases, 2, TP2[cases])


def _reference(model_name: str, optimizer: str, loss_name: str) -> dict:
    model = FACTORIES[model_name]()
    return train_reference(model, optimizer, STEPS, (BATCH[0],), BATCH[1], LOSSES[loss_name])


def _check(per_rank: list[dict], case: tuple, tp: int) -> None:
    model_name, optimizer, loss_name, pins = case
    reference = _reference(model_name, optimizer, loss_name)
    standard = loss_name != "smoothed"
    pipelined = pins.get("pp", 1) > 1
    for rank, results in enumerate(per_rank):
        result = dict(results[_key(*case)])
        assert result.pop("parallel_loss") == standard, rank
        widths = result.pop("loss_widths")
        if not pipelined:
            assert result.pop("forward_width") == VOCAB, rank  # pm(...) gives them whole
            assert result.pop("flat_target_gap") < 1e-6, rank
            # Sharded all the way to the loss, or gathered in the graph for the user's.
            assert result.pop("program_width") == (VOCAB // tp if standard else VOCAB), rank
        last_stage = not pipelined or rank >= len(per_rank) // 2  # pp is the outer axis
        assert widths == ({VOCAB // tp} if standard and last_stage else set()), rank
        if not standard:
            assert result["gathers"], rank
        result.pop("gathers")
        assert_matches(result, reference)


@pytest.mark.parametrize(
    "cases, case",
    [
        *(pytest.param("quick", c, marks=pytest.mark.slow) for c in TP2["quick"]),
        *(pytest.param("more", c, marks=pytest.mark.slow) for c in TP2["more"]),
    ],
    ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}" if isinstance(c, tuple) else c,
)
def test_vocabulary_parallel_loss_at_tp2_matches_single_device(cases, case):
    _check(_tp2(cases), case, tp=2)


WORLD4 = [
    ("llama", "sgd", "standard", {"dp": 2, "tp": 2}),
    ("llama", "adamw", "standard", {"dp": 2, "tp": 2}),
    ("gpt2", "sgd", "standard", {"dp": 2, "tp": 2}),
    ("llama", "sgd", "smoothed", {"dp": 2, "tp": 2}),
    ("llama", "sgd", "standard", {"tp": 2, "pp": 2, "schedule": "1f1b", "microbatches": 2}),
]


@functools.cache
def _world4() -> dict:
    return run_world(_train_cases, 4, WORLD4)


@pytest.mark.slow
@pytest.mark.parametrize("case", WORLD4, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}-{c[3]}")
def test_vocabulary_parallel_loss_on_four_ranks_matches_single_device(case):
    _check(_world4(), case, tp=2)
