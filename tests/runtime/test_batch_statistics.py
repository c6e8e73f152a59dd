"""A mixture-of-experts load-balancing loss (Mixtral's `output_router_logits=True`: the
fraction of tokens routed to each expert times their mean router probability) under a
split of the batch over dp or ep (2 Gloo ranks): each statistic is the mean of the
replicas' (passes/batch_statistics.py), so the loss, and training, are one device's."""

from __future__ import annotations

from typing import Any

import pytest

import autopart
from autopart.testing import run_world
from tests.models import (
    assert_matches,
    lm_and_router_loss,
    make_optimizer,
    tiny_mixtral,
    token_batch,
    train_reference,
)

STEPS = 3


def _trained(batch: tuple, pins: dict[str, Any]) -> dict[str, Any]:
    ids, target = batch
    pm = autopart.parallelize(
        tiny_mixtral(router_loss=True),
        autopart.Mesh.local(),
        (ids,),
        loss_fn=lm_and_router_loss,
        optimizer=make_optimizer("adamw"),
        **{"tp": 1, "cp": 1, "pp": 1, **pins},
    )
    losses = [pm.train_step(ids, target).item() for _ in range(STEPS)]
    result = {"losses": losses, "params": pm.full_state_dict(), "explain": pm.plan.explain()}
    pm.close()
    return result


@pytest.mark.slow
@pytest.mark.parametrize("pins", [{"dp": 2, "ep": 1}, {"dp": 1, "ep": 2}], ids=["dp2", "ep2"])
def test_a_load_balancing_loss_trains_like_one_device_under_a_split_of_the_batch(pins):
    batch = token_batch(8)
    want = train_reference(
        tiny_mixtral(router_loss=True), "adamw", STEPS, batch[:1], batch[1], lm_and_router_loss
    )
    for result in run_world(_trained, 2, batch, pins):
        diff = max(abs(g - w) / w for g, w in zip(result["losses"], want["losses"], strict=True))
        print(f"{pins}: losses within {diff:.1e} of one device")
        assert_matches(result, want, rtol=1e-5)
