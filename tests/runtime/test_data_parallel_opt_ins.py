"""Data-parallel options that change the math, opt-in, on Gloo (dp=2, SGD):

- local SGD (`sync_every=H`): replicas step on their own gradients and average their
  parameters every H steps, after `sync_warmup` steps of plain data parallelism. H = 1
  is plain data parallelism; H = 2 is what two replicas trained apart and averaged
  give, which is not one device's result;
- gradient compression (`grad_compression=`): bf16 all-reduce stays within bf16's
  rounding of one device; PowerSGD at a rank equal to every matrix's smaller side is
  the exact mean through its factors, and at a lower rank it is not."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopart
from autopart.plan import PlanError
from autopart.testing import run_world
from tests.models import assert_matches, make_optimizer, snapshot, train_replicas_apart

STEPS = 5
DP = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)


def _train(pins: dict) -> dict:
    x, target = _batch()
    pm = autopart.parallelize(
        _model(),
        autopart.Mesh.local(),
        (x,),
        loss_fn=nn.functional.mse_loss,
        optimizer=make_optimizer("sgd"),
        dp=DP,
        **pins,
    )
    losses = [pm.train_step(x, target).item() for _ in range(STEPS)]
    result = {"losses": losses, "params": pm.full_state_dict(), "explain": pm.plan.explain()}
    pm.close()
    return result


def _train_all(cases: dict[str, dict]) -> dict[str, dict]:
    return {name: _train(pins) for name, pins in cases.items()}


def _replicas_apart(every: int, warmup: int, outer: dict | None = None) -> dict:
    x, target = _batch()
    return train_replicas_apart(
        _model, "sgd", STEPS, (x,), target, DP, every, warmup, outer, nn.functional.mse_loss
    )


def _one_device() -> dict:
    x, target = _batch()
    model = _model()
    opt = make_optimizer("sgd")(model.parameters())
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": snapshot(model)}


@pytest.fixture(scope="module")
def trained() -> dict[str, dict]:
    cases = {
        "every_1": {"sync_every": 1},
        "every_2_after_1": {"sync_every": 2, "sync_warmup": 1},
        "outer_nesterov": {
            "sync_every": 2,
            "sync_warmup": 1,
            "outer_optimizer": "sgd:lr=0.7,momentum=0.9,nesterov",
        },
        "plain": {},
        "bf16": {"grad_compression": "bf16"},
        "powersgd_full": {"grad_compression": "powersgd:rank=8"},  # the matrices' 8 rows/columns
        "powersgd_low": {"grad_compression": "powersgd:rank=2"},
    }
    return run_world(_train_all, DP, cases)[0]


@pytest.mark.slow  # one world of 2 trains every case
def test_averaging_every_step_with_sgd_is_plain_data_parallelism(trained):
    assert_matches(trained["every_1"], _one_device())
    assert_matches(trained["plain"], _one_device())


@pytest.mark.slow  # one world of 2 trains every case
def test_averaging_every_two_steps_is_two_replicas_trained_apart(trained):
    result = trained["every_2_after_1"]
    assert_matches(result, _replicas_apart(every=2, warmup=1))
    # ... which is not one device's training: the test would notice a plain all-reduce.
    with pytest.raises(AssertionError):
        assert_matches(result, _one_device())
    assert "Local SGD, as asked (sync_every=2)" in trained["every_2_after_1"]["explain"]
    assert "This changes the math" in trained["every_2_after_1"]["explain"]


def test_local_sgd_refuses_zero():
    x, _ = _batch()
    mesh = autopart.Mesh.cluster("cpu", 1, 2)
    with pytest.raises(PlanError, match="ZeRO-1 shards: use zero=0"):
        autopart.plan(_model(), mesh, (x,), dp=2, zero=1, sync_every=2)
    plan = autopart.plan(_model(), mesh, (x,), dp=2, sync_every=2)
    assert plan.zero == 0 and plan.sync_every == 2


@pytest.mark.slow  # one world of 2 trains every case
def test_an_outer_optimizer_steps_the_anchor_by_the_replicas_mean(trained):
    """DiLoCo's outer step (Nesterov SGD on the anchor's difference from the mean) as
    two replicas trained apart give it, which plain averaging does not."""
    result = trained["outer_nesterov"]
    outer = {"lr": 0.7, "momentum": 0.9, "nesterov": True}
    assert_matches(result, _replicas_apart(every=2, warmup=1, outer=outer))
    with pytest.raises(AssertionError):
        assert_matches(result, _replicas_apart(every=2, warmup=1))
    assert "The outer optimizer (sgd:lr=0.7,momentum=0.9,nesterov)" in result["explain"]


@pytest.mark.parametrize(
    ("pins", "message"),
    [
        ({"outer_optimizer": "sgd:lr=0.7"}, "it needs sync_every=H"),
        ({"sync_every": 2, "outer_optimizer": "adam:lr=1"}, "must be 'sgd:lr=L"),
        ({"sync_every": 2, "outer_optimizer": "sgd:lr=1,nesterov"}, "needs momentum > 0"),
    ],
)
def test_an_outer_optimizer_it_cannot_run_is_refused(pins, message):
    x, _ = _batch()
    mesh = autopart.Mesh.cluster("cpu", nodes=1, per_node=2)
    with pytest.raises(PlanError, match=message):
        autopart.plan(_model(), mesh, (x,), dp=2, **pins)


@pytest.mark.slow  # one world of 2 trains every case
def test_bf16_gradients_stay_within_bf16_rounding_of_one_device(trained):
    assert_matches(trained["bf16"], _one_device(), rtol=2e-2)
    with pytest.raises(AssertionError):
        assert_matches(trained["bf16"], _one_device(), rtol=1e-6)
    assert "Gradient compression, as asked (bf16)" in trained["bf16"]["explain"]


@pytest.mark.slow  # one world of 2 trains every case
def test_powersgd_at_full_rank_is_the_exact_mean_through_its_factors(trained):
    assert_matches(trained["powersgd_full"], _one_device())


@pytest.mark.slow  # one world of 2 trains every case
def test_powersgd_at_low_rank_changes_the_math_and_says_so(trained):
    result, one = trained["powersgd_low"], _one_device()
    assert result["losses"][0] == pytest.approx(one["losses"][0], rel=1e-6)  # before any step
    with pytest.raises(AssertionError):
        assert_matches(result, one, rtol=1e-3)
    assert "PowerSGD's low-rank factors" in result["explain"]
    assert "This changes the math" in result["explain"]


@pytest.mark.parametrize(
    "pins, message",
    [
        ({"grad_compression": "bf16", "zero": 2}, "use zero=0 and no sync_every"),
        ({"grad_compression": "powersgd:rank=0"}, "must be 'bf16' or 'powersgd:rank=R'"),
        ({"grad_compression": "int8"}, "must be 'bf16' or 'powersgd:rank=R'"),
    ],
)
def test_gradient_compression_refuses_what_it_cannot_run(pins, message):
    x, _ = _batch()
    with pytest.raises(PlanError, match=message):
        autopart.plan(_model(), autopart.Mesh.cluster("cpu", 1, 2), (x,), dp=2, **pins)
