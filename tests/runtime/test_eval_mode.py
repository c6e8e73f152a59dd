"""Train and eval modes: after `pm.eval()`, `pm.evaluate` and `pm(...)` give the model's
eval-mode numbers on one device (dropout off, batch normalization on its running
statistics) under each axis, before and between training steps, and `pm.train()`
trains again.

Dropout draws other masks on each rank than on one device, so a model with dropout
trains to other weights than the reference does: each eval-mode number is compared
with the reference model holding the weights the ranks hold then (gathered whole).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopart
from autopart.testing import run_world
from tests.harness import parallelize_lm, train_losses
from tests.models import lm_loss, make_optimizer, tiny_gpt2, token_batch

DROPOUT = 0.2
ROUNDS = 2  # eval, then train 2 steps; twice


def dropout_gpt2(layers: int = 2) -> nn.Module:
    """A tiny GPT-2 with dropout on the embeddings, attention and residuals."""
    return tiny_gpt2(layers=layers, dropout=DROPOUT)


def _rounds(pins: dict, batch) -> dict:
    """Eval-mode losses, and outputs where pm(...) runs, each with the weights the ranks
    hold then, between rounds of training; then the losses of both modes at the same
    weights."""
    ids, target = batch
    pm = parallelize_lm(dropout_gpt2(_layers(pins)), batch, **pins)
    local = pm.local_batch((ids,))[0]
    out: dict = {"local": local, "eval": [], "logits": [], "weights": [], "kept": []}
    for _ in range(ROUNDS):
        pm.eval()
        out["weights"].append(pm.full_state_dict())
        out["eval"].append(pm.evaluate(ids, target).item())
        if pm.plan.pp == 1:
            with torch.no_grad():
                out["logits"].append(pm(local).logits)
        out["kept"].append(_same(out["weights"][-1], pm.full_state_dict()))
        pm.train()
        train_losses(pm, batch, 2)
    pm.eval()
    evaluated = pm.evaluate(ids, target).item()
    pm.train()
    out["modes"] = (evaluated, pm.training, pm.evaluate(ids, target).item())
    pm.close()
    return out


def _layers(pins: dict) -> int:
    return 4 if pins.get("pp") else 2  # a pipeline's 2 stages take 2 blocks each


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _holding(weights: dict[str, torch.Tensor], layers: int) -> nn.Module:
    """The model on one device, in eval mode, holding `weights` (every parameter)."""
    model = dropout_gpt2(layers)
    assert weights.keys() == dict(model.named_parameters()).keys()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])
    return model.eval()


# dp=2 ZeRO-3 (whose forward gathers its parameters from the trained shards) runs in the
# quick suite; the pipeline (the schedule forward only, tied weights across stages) and
# the rest with the slow sweeps.
PLANS = [
    {"dp": 2, "zero": 3},
    pytest.param({"pp": 2, "microbatches": 2}, marks=pytest.mark.slow),
    pytest.param({"dp": 2}, marks=pytest.mark.slow),
    pytest.param({"dp": 2, "zero": 1}, marks=pytest.mark.slow),
    pytest.param({"dp": 2, "zero": 2}, marks=pytest.mark.slow),
    pytest.param({"tp": 2}, marks=pytest.mark.slow),
    pytest.param({"dp": 2, "tp": 2, "zero": 1}, marks=pytest.mark.slow),  # on 4 ranks
]


@pytest.mark.parametrize("pins", PLANS, ids=str)
def test_eval_mode_gives_the_models_eval_numbers_between_training_steps(pins):
    batch = token_batch(batch=8)
    ids, target = batch
    world = math.prod(pins.get(axis, 1) for axis in ("dp", "tp", "pp"))
    for rank, result in enumerate(run_world(_rounds, world, pins, batch)):
        for i, weights in enumerate(result["weights"]):
            model = _holding(weights, _layers(pins))
            with torch.no_grad():
                want = lm_loss(model(ids), target).item()
                if result["logits"]:
                    logits = model(result["local"]).logits
                    torch.testing.assert_close(result["logits"][i], logits, rtol=1e-5, atol=1e-5)
            got = result["eval"][i]
            assert abs(got - want) <= 1e-5 * abs(want), f"rank {rank}, round {i}: {got} != {want}"
            assert result["kept"][i], f"rank {rank}, round {i}: evaluating changed the weights"
        evaluated, training, trained = result["modes"]
        # Back in training mode, dropout is on again.
        assert training and abs(trained - evaluated) > 1e-3, (rank, trained, evaluated)


class BatchNormNet(nn.Module):
    """Blocks of linear, batch normalization and ReLU: a model whose eval mode reads the
    running statistics that training mode updates."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU())
            for _ in range(4)
        )
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _classes(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, target)


# Plans that keep the batch whole: tests/runtime/test_batch_norm.py checks the running
# statistics that plans splitting it over replicas leave (passes/batch_norm.py).
BATCH_NORM_PLANS = [{"tp": 2}, {"pp": 2, "microbatches": 1}]


def _alternate(model: nn.Module, step: Callable, evaluate: Callable, forward: Callable) -> list:
    """Eval-mode loss and output, training-mode loss (forward only), two steps; twice."""
    out = []
    for _ in range(ROUNDS):
        model.eval()
        out += [evaluate(), forward()]
        model.train()
        out += [evaluate(), step(), step()]
    return out


def _batch_norm_rounds(inputs: torch.Tensor, target: torch.Tensor) -> dict:
    out = {}
    for pins in BATCH_NORM_PLANS:
        pm = autopart.parallelize(
            BatchNormNet(),
            autopart.Mesh.local(),
            (inputs,),
            loss_fn=_classes,
            optimizer=make_optimizer("sgd"),
            **pins,
        )
        local = pm.local_batch((inputs,))[0]

        def forward(pm=pm, local=local):
            if pm.plan.pp > 1:
                return None
            with torch.no_grad():
                return pm(local)

        out[str(pins)] = _alternate(
            pm,
            lambda pm=pm: pm.train_step(inputs, target).item(),
            lambda pm=pm: pm.evaluate(inputs, target).item(),
            forward,
        )
        pm.close()
    return out


def _batch_norm_reference(inputs: torch.Tensor, target: torch.Tensor) -> list:
    model = BatchNormNet()
    optimizer = make_optimizer("sgd")(model.parameters())

    def step() -> float:
        optimizer.zero_grad()
        loss = _classes(model(inputs), target)
        loss.backward()
        optimizer.step()
        return loss.item()

    def evaluate() -> float:
        with torch.no_grad():
            return _classes(model(inputs), target).item()

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return model(inputs)

    return _alternate(model, step, evaluate, forward)


def test_batch_norm_trains_on_batch_statistics_and_evaluates_on_running_ones():
    """Training steps, training-mode losses (which update the running statistics) and
    eval-mode losses and outputs, alternately, as on one device."""
    g = torch.Generator().manual_seed(1)
    inputs = torch.randn(8, 16, generator=g)
    target = torch.randint(0, 4, (8,), generator=g)
    want = _batch_norm_reference(inputs, target)
    for rank, results in enumerate(run_world(_batch_norm_rounds, 2, inputs, target)):
        for pins, got in results.items():
            for i, (a, b) in enumerate(zip(got, want, strict=True)):
                if isinstance(a, float):
                    assert abs(a - b) <= 1e-5 * abs(b), f"{pins}, rank {rank}, value {i}"
                elif a is not None:  # pm(...) where it runs (pp = 1)
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
