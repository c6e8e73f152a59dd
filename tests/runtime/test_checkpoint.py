"""Sharded checkpoints: each rank writes and reads only its own pieces of parameters and
optimizer state, and a run saved under one plan resumes under another with the losses
of a run that never stopped (AdamW moments and step counts included)."""

from __future__ import annotations

import pytest
import torch

import autopart
from autopart.testing import run_world
from tests.harness import parallelize_lm, train_losses
from tests.models import (
    assert_matches,
    make_optimizer,
    tiny_llama,
    token_batch,
    train_reference,
    train_single_device,
)

BEFORE, AFTER = 2, 2  # steps under the first plan, then under the second


def _resume(cases, checkpoint_root, batch) -> dict:
    """For each (first pins, second pins): train under the first plan, save, build the
    second from a model with other random weights (only the checkpoint can make it
    right), load, train on. Also the second plan given the parameters only."""
    out = {}
    for i, (first, second) in enumerate(cases):
        path = f"{checkpoint_root}/{i}"
        pm = parallelize_lm(tiny_llama(seed=0), batch, **first)
        losses = train_losses(pm, batch, BEFORE)
        autopart.save_checkpoint(pm, path)
        pm.close()
        resumed = parallelize_lm(tiny_llama(seed=1), batch, **second)
        autopart.load_checkpoint(resumed, path)
        steps = resumed.steps
        losses += train_losses(resumed, batch, AFTER)
        key = (tuple(first.items()), tuple(second.items()))
        out[key] = {"losses": losses, "params": resumed.full_state_dict(), "steps": steps}
        resumed.close()
        weights_only = parallelize_lm(tiny_llama(seed=1), batch, weights=path, **second)
        out[key]["weights_only"] = train_losses(weights_only, batch, AFTER)
        weights_only.close()
    return out


def _check(per_rank: list[dict], reference: dict) -> None:
    for rank, results in enumerate(per_rank):
        for case, result in results.items():
            assert result["steps"] == BEFORE, (case, rank)
            try:
                assert_matches(result, reference)
            except AssertionError as e:
                raise AssertionError(f"{case}: rank {rank}: {e}") from e
            # Given the parameters alone, the first step after the restart has the
            # right loss (the update comes after it) and the second leaves the
            # trajectory: the comparison above catches a checkpoint that lost the
            # optimizer's state.
            restarted = result["weights_only"]
            assert restarted[0] == pytest.approx(reference["losses"][BEFORE], rel=1e-5), case
            assert restarted[1] != pytest.approx(reference["losses"][BEFORE + 1], rel=1e-4), case


# From ZeRO-1 into ZeRO-3; the slow suite also from tensor parallelism into ZeRO-2 and
# from plain data parallelism into tensor parallelism.
RESUMED = [({"dp": 2, "zero": 1}, {"dp": 2, "zero": 3})]
MORE_RESUMED = [({"tp": 2}, {"dp": 2, "zero": 2}), ({"dp": 2, "zero": 0}, {"tp": 2})]


@pytest.mark.parametrize(
    "cases", [RESUMED, pytest.param(MORE_RESUMED, marks=pytest.mark.slow)], ids=["zero", "more"]
)
def test_a_checkpoint_resumes_under_another_plan_on_two_ranks(tmp_path, cases):
    batch = token_batch(8)
    per_rank = run_world(_resume, 2, cases, str(tmp_path), batch)
    _check(per_rank, train_single_device("llama", "adamw", BEFORE + AFTER, batch))


@pytest.mark.slow  # another world of 2: kept out of the quick suite
def test_an_offloaded_optimizer_state_resumes_on_the_one_device_trajectory(tmp_path):
    """ZeRO offload: the optimizer state in host memory, stepped there, saved from one
    stage and loaded into another, and from ZeRO-3's shards into a single replica's."""
    batch = token_batch(8)
    cases = [
        ({"dp": 2, "zero": 2, "offload": True}, {"dp": 2, "zero": 1, "offload": True}),
        ({"dp": 2, "zero": 3, "offload": True}, {"tp": 2, "offload": True}),
    ]
    per_rank = run_world(_resume, 2, cases, str(tmp_path), batch)
    _check(per_rank, train_single_device("llama", "adamw", BEFORE + AFTER, batch))


@pytest.mark.slow  # a world of 4 processes: kept out of the quick suite
def test_a_checkpoint_from_tensor_and_pipeline_parallelism_resumes_under_zero3(tmp_path):
    batch = token_batch(8)
    cases = [({"tp": 2, "pp": 2}, {"dp": 4, "zero": 3})]
    per_rank = run_world(_resume, 4, cases, str(tmp_path), batch)
    _check(per_rank, train_single_device("llama", "adamw", BEFORE + AFTER, batch))


def _load_another_models_checkpoint(checkpoint_dir, batch) -> dict:
    """A 1-layer model's checkpoint into 2 layers, and a 2-layer one into 1 layer, the
    second under a pipeline whose ranks hold different parameters."""
    messages = {}
    for saved, loaded, pins in ((1, 2, {"dp": 2}), (2, 1, {"pp": 2})):
        path = f"{checkpoint_dir}/{saved}"
        pm = parallelize_lm(tiny_llama(seed=0, layers=saved), batch, dp=2)
        autopart.save_checkpoint(pm, path)
        other = parallelize_lm(tiny_llama(seed=0, layers=loaded), batch, **pins)
        try:
            autopart.load_checkpoint(other, path)
            messages[saved] = "loaded"
        except autopart.CheckpointError as e:
            messages[saved] = str(e)
    return messages


@pytest.mark.slow  # another world of 2 that saves and loads
def test_a_checkpoint_of_another_model_is_refused_by_name_on_every_rank(tmp_path):
    messages = run_world(_load_another_models_checkpoint, 2, str(tmp_path), token_batch(8))
    assert messages[0] == messages[1]
    lacking, extra = messages[0][1], messages[0][2]
    assert "has no parameter 'model.layers.1." in lacking and "another model" in lacking
    assert "parameters this model does not have" in extra and "model.layers.1." in extra


def _export(directory, batch):
    model = tiny_llama(seed=0)
    pm = parallelize_lm(model, batch, tp=2)
    train_losses(pm, batch, BEFORE)
    autopart.export(pm, directory, config=model.config)


@pytest.mark.slow  # a world, then transformers' from_pretrained
def test_export_writes_a_model_that_from_pretrained_reads(tmp_path):
    from transformers import LlamaForCausalLM

    batch = token_batch(8)
    run_world(_export, 2, str(tmp_path), batch)
    loaded = LlamaForCausalLM.from_pretrained(tmp_path)
    reference = train_single_device("llama", "adamw", BEFORE, batch)
    got = {name: p.detach() for name, p in loaded.named_parameters()}
    assert got.keys() == reference["params"].keys()
    for name, want in reference["params"].items():  # Adam's rounding noise, not layout
        torch.testing.assert_close(got[name], want, rtol=1e-4, atol=1e-5, msg=name)


class _ScaledHead(torch.nn.Module):
    """A 0-dim parameter used last: first in a ZeRO bucket (backward order), whose
    optimizer step, a scalar, must not be taken for state shaped like it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 4)
        self.scale = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x))) * self.scale


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target)


def _scaled_batch():
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _resume_scaled(first: dict, second: dict, path: str) -> list[float]:
    x, y = _scaled_batch()
    optimizer = make_optimizer("adamw")
    mesh = autopart.Mesh.local()
    pm = autopart.parallelize(_ScaledHead(), mesh, (x,), loss_fn=_mse, optimizer=optimizer, **first)
    losses = [pm.train_step(x, y).item() for _ in range(BEFORE)]
    autopart.save_checkpoint(pm, path)
    pm.close()
    resumed = autopart.parallelize(
        _ScaledHead(), mesh, (x,), loss_fn=_mse, optimizer=optimizer, **second
    )
    autopart.load_checkpoint(resumed, path)
    return losses + [resumed.train_step(x, y).item() for _ in range(AFTER)]


@pytest.mark.slow  # a third checkpoint world; the two-rank resume covers the mechanism
def test_a_zero_dimensional_parameter_resumes_with_its_optimizer_state(tmp_path):
    x, y = _scaled_batch()
    reference = train_reference(_ScaledHead(), "adamw", BEFORE + AFTER, (x,), y, _mse)
    cases = [({"dp": 2, "zero": 1}, {"dp": 2, "zero": 0}), ({"dp": 2, "zero": 0}, {"zero": 2})]
    for i, (first, second) in enumerate(cases):
        losses = run_world(_resume_scaled, 2, first, second, str(tmp_path / str(i)))[0]
        assert losses == pytest.approx(reference["losses"], rel=1e-5), (first, second)
