"""ZeRO offload against one device: the optimizer steps host copies of ZeRO's shards
(stages 1-3), or of a single replica's whole parameters (dp=1, here under tp), and its
state never sits beside the device's parameters.

SGD with momentum: a gradient sent down before its last microbatch, or before the
loss scale is taken out of it, moves SGD's parameters by far more than rounding."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from autopart.runtime.offload import HostOptimizer
from autopart.testing import run_world
from tests.harness import parallelize_lm, train_losses
from tests.models import (
    assert_matches,
    tiny_llama,
    token_batch,
    train_autocast_reference,
    train_single_device,
)

STEPS = 3
# The quick suite offloads ZeRO-3's shards; the slow, the other holdings and fp16.
CASES = [({"dp": 2, "zero": 3, "microbatches": 2}, "fp32")]  # ZeRO-3's parameter shards
MORE_CASES = [
    ({"dp": 2, "zero": 2, "microbatches": 2}, "fp32"),
    ({"tp": 2, "microbatches": 2}, "fp32"),  # dp=1: the whole state on the host
    ({"dp": 2, "zero": 1}, "fp16-mixed"),  # the loss-scale check reads the host's gradients
]


def _train(batch, cases) -> dict:
    out = {}
    for pins, precision in cases:
        pm = parallelize_lm(tiny_llama(), batch, "sgd", precision=precision, offload=True, **pins)
        assert pm.plan.offload
        offloaded = pm.state.offloaded
        stepped = {id(p) for group in pm.optimizer.param_groups for p in group["params"]}
        losses = train_losses(pm, batch, STEPS)
        out[str(pins)] = {
            "losses": losses,
            "params": pm.full_state_dict(),
            "host_copies": offloaded is not None
            and stepped == {id(h) for h in offloaded.host}
            and not stepped & {id(p) for p in pm.parameters()},
        }
        pm.close()
    return out


@pytest.mark.parametrize("cases", [CASES, pytest.param(MORE_CASES, marks=pytest.mark.slow)])
def test_offloaded_optimizers_train_like_one_device(cases):
    batch = token_batch(8)
    fp32 = train_single_device("llama", "sgd", STEPS, batch)
    fp16 = train_autocast_reference("llama", "fp16-mixed", STEPS, batch)
    for rank, results in enumerate(run_world(_train, 2, batch, cases)):
        for pins, precision in cases:
            result = results[str(pins)]
            assert result["host_copies"], (pins, rank)
            if precision == "fp32":
                assert_matches(result, fp32)
            else:
                assert result["losses"] == pytest.approx(fp16, rel=1e-3), (pins, rank)
    assert fp16[-1] < fp16[0] and torch.isfinite(torch.tensor(fp16)).all()


def _frozen_embedding(batch) -> list[list[float]]:
    """A model whose embedding is frozen, trained with and without offload at dp=1."""
    out = []
    for offload in (True, False):
        model = tiny_llama()
        model.model.embed_tokens.weight.requires_grad_(False)
        pm = parallelize_lm(model, batch, "sgd", tp=2, offload=offload)
        out.append(train_losses(pm, batch, STEPS))
        pm.close()
    return out


@pytest.mark.slow  # another world of 2: kept out of the quick suite
def test_a_model_with_a_frozen_parameter_trains_alike_with_offload():
    for offloaded, on_device in run_world(_frozen_embedding, 2, token_batch(8)):
        assert offloaded == pytest.approx(on_device, rel=1e-6)


def test_the_host_steps_tile_by_tile_and_sends_each_up_as_it_leaves_it():
    """Six 64-element tensors, tiles of two: a tile goes up before the next is stepped,
    while the user's optimizer keeps its one parameter group (a learning rate set on it
    reaches every tile, a step hook sees it once), and the result is the plain
    optimizer's over the same gradients."""
    seeded = [torch.Generator().manual_seed(i) for i in range(6)]
    params = [nn.Parameter(torch.randn(64, generator=g)) for g in seeded]
    reference = [nn.Parameter(p.detach().clone()) for p in params]
    factory = functools.partial(torch.optim.AdamW, lr=0.1)
    offloaded = HostOptimizer(params, factory, tile_bytes=2 * 64 * 4)
    plain = factory(reference)
    hooked: list[int] = []
    offloaded.optimizer.register_step_pre_hook(lambda opt, *_: hooked.append(1))
    stepped_when_sent: list[list[bool]] = []
    send_up = offloaded._send_up

    def watch(indices: list[int]) -> None:
        state = offloaded.optimizer.state
        stepped_when_sent.append([h in state for h in offloaded.host])
        send_up(indices)

    offloaded._send_up = watch  # type: ignore[method-assign]
    for step in range(2):
        for i, (p, r) in enumerate(zip(params, reference)):
            grad = torch.randn(64, generator=torch.Generator().manual_seed(100 * step + i))
            p.grad, r.grad = grad.clone(), grad.clone()
        for opt in (offloaded.optimizer, plain):
            opt.param_groups[0]["lr"] = 0.1 / (step + 1)
        offloaded.begin()
        offloaded.all_down()
        offloaded.step()
        plain.step()
    assert len(offloaded.optimizer.param_groups) == 1 and hooked == [1, 1]
    # First step: tile k went up when tiles 0..k had been stepped and the rest not yet.
    assert stepped_when_sent[:3] == [
        [True, True, False, False, False, False],
        [True, True, True, True, False, False],
        [True] * 6,
    ]
    for p, r in zip(params, reference):
        assert torch.equal(p.detach(), r.detach())
