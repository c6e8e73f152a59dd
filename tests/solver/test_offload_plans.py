"""Planning ZeRO offload, on the meta device: Llama-2-7B's shape on one node of 8 A10s
(24 GB each, PCIe), 8 sequences per step.

At 4096 tokens a sequence the model fits on the devices (its parameters, gradients
and optimizer state sharded over tp × dp), and nothing is offloaded. At 96k tokens
the activations take what the state leaves: every plan that keeps the optimizer state
on the device exceeds 24 GB, the solver moves it to the host, says why, and the plan
fits."""

from __future__ import annotations

import pytest
import torch

from autopart.mesh import Mesh
from autopart.plan import PlanError
from tests.harness import plan_lm
from tests.models import llama2_7b_on_meta

SEQUENCES, SHORT, LONG, LONGER = 8, 4096, 96 * 1024, 160 * 1024
MESH = Mesh.cluster("a10-24g", nodes=1, per_node=8)


def _plan(tokens: int, **pins):
    ids = torch.zeros(SEQUENCES, tokens, dtype=torch.long, device="meta")
    return plan_lm(llama2_7b_on_meta(tokens), ids, MESH, **pins)


@pytest.mark.slow
def test_a_7b_model_on_8_24gb_devices_offloads_only_where_nothing_else_fits():
    memory = MESH.device.memory_bytes
    short = _plan(SHORT)
    assert not short.offload, short.explain()
    assert short.predicted.peak_memory_bytes <= memory

    with pytest.raises(PlanError, match="no plan fits") as on_device:
        _plan(LONG, offload=False)
    plan = _plan(LONG)
    assert plan.offload, plan.explain()
    assert plan.predicted.peak_memory_bytes <= memory
    assert plan.predicted.memory["optimizer"] == 0
    why = "chosen because no plan keeping the optimizer state on the device fits"
    assert why in plan.explain()
    # The reason names the smallest plan on the device and what it lacks, as the
    # refusal without offload does.
    assert plan.offload_reason.split(" needs ")[0] in str(on_device.value)


@pytest.mark.slow
def test_fp32_master_weights_on_the_host_fit_what_offload_alone_cannot():
    """At 160k tokens not even the offloaded plans fit; the refusal says that keeping the
    master weights on the host would, and with it pinned the plan fits, its device
    weights and gradients half the bytes of the offloaded plan's at 96k."""
    memory = MESH.device.memory_bytes
    with pytest.raises(PlanError, match="master_weights='host'.*a plan fits"):
        _plan(LONGER)
    plan = _plan(LONGER, master_weights="host")
    assert plan.offload and plan.master_weights == "host", plan.explain()
    assert plan.predicted.peak_memory_bytes <= memory
    assert "This changes the math" in plan.explain()
    device_masters = _plan(LONG).predicted.memory
    host_masters = _plan(LONG, master_weights="host").predicted.memory
    assert plan.degrees == _plan(LONG).degrees  # the same layout: the bytes compare
    for part in ("parameters", "gradients"):
        assert host_masters[part] == pytest.approx(device_masters[part] / 2, rel=1e-6)
