"""Mixed precision: bf16/fp16 compute over fp32 master weights, against single-device
autocast; fp16 loss scaling skips overflowing steps on every rank alike.

SGD, every rank, within 1e-3 relative: the runs differ only by reduction order (measured
at most 7e-5 over these cases), while a gradient scaled wrong by 2 moves SGD's
parameters, and the next losses, by far more."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from autopart.runtime.precision import LossScaler
from autopart.testing import run_world
from tests.harness import parallelize_lm, train_losses
from tests.models import (
    LM_FACTORIES,
    lm_loss,
    make_optimizer,
    token_batch,
    train_autocast_reference,
)

STEPS = 5
# Both low dtypes in the quick suite; the other axes under them in the slow one.
CASES = [
    ("llama", {"dp": 2}, "bf16-mixed"),
    ("gpt2", {"dp": 2}, "fp16-mixed"),
]
MORE_CASES = [
    ("llama", {"tp": 2}, "bf16-mixed"),
    ("gpt2", {"dp": 2, "zero": 2}, "bf16-mixed"),
    ("llama", {"pp": 2, "schedule": "1f1b", "microbatches": 2}, "bf16-mixed"),
]


def _key(name, pins, precision):
    return name, precision, tuple(pins.items())


def _train(cases, batch):
    out = {}
    for name, pins, precision in cases:
        pm = parallelize_lm(LM_FACTORIES[name](), batch, "sgd", precision=precision, **pins)
        losses = train_losses(pm, batch, STEPS)
        out[_key(name, pins, precision)] = (losses, [p.dtype for p in pm.parameters()])
        pm.close()
    return out


@pytest.mark.parametrize(
    "cases", [CASES, pytest.param(MORE_CASES, marks=pytest.mark.slow)], ids=["dp", "more"]
)
def test_mixed_precision_tracks_single_device_autocast(cases):
    batch = token_batch(8)
    per_rank = run_world(_train, 2, cases, batch)
    for name, pins, precision in cases:
        reference = train_autocast_reference(name, precision, STEPS, batch)
        for rank, results in enumerate(per_rank):
            losses, dtypes = results[_key(name, pins, precision)]
            assert set(dtypes) == {torch.float32}  # master weights stay fp32
            assert losses == pytest.approx(reference, rel=1e-3), (name, pins, precision, rank)
        assert reference[-1] < reference[0]


def _overflow_on_one_rank():
    scaler = LossScaler(initial=1024.0)
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2048.0)
    if dist.get_rank() == 1:
        p.grad[0] = float("inf")
    finite = scaler.unscale([p])
    return finite, scaler.value, p.grad


def test_an_overflow_on_one_rank_skips_the_step_everywhere():
    for finite, scale, grad in run_world(_overflow_on_one_rank, 2):
        assert finite is False and scale == 512.0 and grad is None
    scaler = LossScaler(initial=8.0, growth_interval=2)
    p = torch.nn.Parameter(torch.ones(2))
    for _ in range(2):
        p.grad = torch.full((2,), 8.0)
        assert scaler.unscale([p])
    assert torch.equal(p.grad, torch.ones(2)) and scaler.value == 16.0


OVERFLOW_TOKEN = 99  # a target only rank 1's half of the batch holds


def _loss_that_overflows_on_rank_1(output, target):
    """The usual loss, scaled past fp16's range where the target holds OVERFLOW_TOKEN:
    that rank's fp16 gradients overflow, the other's do not."""
    flag = (target == OVERFLOW_TOKEN).any()
    return lm_loss(output, target) * torch.where(flag, 1e30, 1.0)


def _overflow_in_a_real_step(batch, poisoned):
    import autopart

    ids, target = batch
    pm = autopart.parallelize(
        LM_FACTORIES["gpt2"](),
        autopart.Mesh.local(),
        (ids,),
        loss_fn=_loss_that_overflows_on_rank_1,
        optimizer=make_optimizer("sgd"),
        dp=2,
        precision="fp16-mixed",
    )
    pm.train_step(ids, target)
    before = {n: p.detach().clone() for n, p in pm.named_parameters()}
    scale = pm.precision.scaler.value
    pm.train_step(ids, poisoned)  # overflows on rank 1 only
    unchanged = all(torch.equal(p, before[n]) for n, p in pm.named_parameters())
    after = pm.precision.scaler.value
    pm.train_step(ids, target)
    moved = not all(torch.equal(p, before[n]) for n, p in pm.named_parameters())
    pm.close()
    return unchanged, scale, after, moved


@pytest.mark.slow  # a world of 2; the skip itself is checked quick
def test_an_overflow_in_a_real_fp16_step_skips_it_on_every_rank():
    ids, target = token_batch(8)
    poisoned = target.clone()
    poisoned[-1, 0] = OVERFLOW_TOKEN  # in the last sample: rank 1's half
    assert not (target == OVERFLOW_TOKEN).any()
    for unchanged, scale, after, moved in run_world(
        _overflow_in_a_real_step, 2, (ids, target), poisoned
    ):
        assert unchanged  # the step was skipped, on both ranks
        assert after == scale / 2  # and the scale backed off alike
        assert moved  # the next step trains again
