"""ZeRO-1 and 2 planned on a calibrated CPU, where every collective is a rendezvous of
ranks time-sliced on shared cores (`cost_models/comm.py`): what they add beyond their
bytes is priced a collective at a time, so plain data parallelism stays where they
only add collectives.

The profile's figures are of the order `autopart calibrate` measures on a 2-core host
with 2 to 4 Gloo ranks; the tests assert what the cost model derives from them."""

from __future__ import annotations

from dataclasses import replace

import autopart
from autopart.cost_models.comm import ALL_REDUCE, CommModel
from autopart.mesh import PRESETS
from tests.models import lm_loss, tiny_gpt2, token_batch

PROFILE = replace(
    PRESETS["cpu"],
    name="cpu-test-profile",
    kernel_launch_s=20e-6,
    optimizer_tensor_s=70e-6,
    collectives={
        "all_reduce": {"alpha": 0.8e-3, "beta": 1e-9},
        "all_gather": {"alpha": 1.0e-3, "beta": 2e-9},
        "reduce_scatter": {"alpha": 1.4e-3, "beta": 3e-9},
    },
    calibration={"device_type": "cpu"},
)


def test_zero_under_context_parallelism_pays_an_all_reduce_a_parameter_tensor():
    # Under ZeRO-1/2 each weight's gradient parts are all-reduced over cp in backward
    # as each is produced (`copy_to_group`): one collective a parameter tensor, where
    # plain data parallelism sums them in its one bucketed all-reduce over dp × cp.
    model = tiny_gpt2()
    tensors = sum(1 for _ in model.parameters())
    ids, _ = token_batch(2, 64)
    mesh = autopart.Mesh.cluster(PROFILE, nodes=1, per_node=4)
    plan = autopart.plan(model, mesh, (ids,), loss_fn=lm_loss, dp=2, cp=2)
    assert plan.zero == 0
    sharded = [a for a in plan.alternatives if a.degrees == plan.degrees and a.zero in (1, 2)]
    assert sharded
    # What the sharded optimizer saves offsets a small part of their latency.
    rendezvous = CommModel(mesh).time(ALL_REDUCE, 1.0, 2)
    for alternative in sharded:
        extra = alternative.step_time_s - plan.predicted.step_time_s
        assert extra > tensors * rendezvous / 2
