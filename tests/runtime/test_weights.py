"""Models built on the meta device: each rank materializes only its own pieces, from a
state dict or a distributed checkpoint, and trains as the real model does."""

from __future__ import annotations

import pytest

import autopart
from autopart.passes.materialize import WeightsError
from autopart.testing import run_world
from tests.harness import parallelize_lm, train_losses
from tests.models import tiny_llama, token_batch, train_single_device

STEPS = 3


def _from_meta(source, checkpoint_dir, batch):
    ids, _ = batch
    reference = tiny_llama()
    if source == "checkpoint":  # write the real model's weights as a checkpoint first
        pm = autopart.parallelize(reference, autopart.Mesh.local(), (ids,))
        autopart.save_checkpoint(pm, checkpoint_dir)
        weights = checkpoint_dir
    else:
        weights = reference.state_dict()
    with autopart.init_empty_weights():
        model = tiny_llama()
    assert all(p.is_meta for p in model.parameters())
    pm = parallelize_lm(model, batch, tp=2, weights=weights)
    local = {n: tuple(p.shape) for n, p in pm.named_parameters()}
    losses = train_losses(pm, batch, STEPS)
    return losses, local


@pytest.mark.parametrize(
    "source", ["state_dict", pytest.param("checkpoint", marks=pytest.mark.slow)]
)
def test_meta_model_loads_its_shards_and_trains_like_the_real_one(source, tmp_path):
    batch = token_batch(8)
    losses, local = run_world(_from_meta, 2, source, str(tmp_path / "ckpt"), batch)[0]
    assert local["stages.0.model.layers.0.mlp.up_proj.weight"] == (64, 64)  # half of 128
    reference = train_single_device("llama", "adamw", STEPS, batch)["losses"]
    assert losses == pytest.approx(reference, rel=1e-5)


def _without_weights(batch):
    with autopart.init_empty_weights():
        model = tiny_llama()
    try:
        autopart.parallelize(model, autopart.Mesh.local(), (batch[0],), tp=2)
    except WeightsError as e:
        return str(e)


@pytest.mark.slow  # another world of 2; a meta model loads its weights quick
def test_meta_model_without_weights_is_a_clear_error():
    message = run_world(_without_weights, 2, token_batch(8))[0]
    assert "meta device" in message and "weights=" in message


def _real_model_with_weights(batch):
    """A real model (seed 0) given the weights of another (seed 1): it must train as
    the other does, never silently keep its own."""
    ids, _ = batch
    weights = tiny_llama(seed=1).state_dict()
    losses = {}
    for pins in ({"dp": 2}, {"tp": 2}):
        pm = parallelize_lm(tiny_llama(seed=0), batch, weights=weights, **pins)
        losses[tuple(pins)] = train_losses(pm, batch, STEPS)
        pm.close()
    return losses


@pytest.mark.slow  # another world of 2; a meta model loads its weights quick
def test_weights_given_to_a_real_model_are_loaded():
    batch = token_batch(8)
    per_rank = run_world(_real_model_with_weights, 2, batch)
    reference = train_single_device("llama", "adamw", STEPS, batch, seed=1)["losses"]
    own = train_single_device("llama", "adamw", STEPS, batch)["losses"]
    assert reference[0] != pytest.approx(own[0], rel=1e-3)  # the two models differ
    for rank, losses in enumerate(per_rank):
        for pins, got in losses.items():
            assert got == pytest.approx(reference, rel=1e-5), (pins, rank)


class _Interrupted(Exception):
    pass


def _interrupted_save(checkpoint_dir, batch) -> dict:
    """Save, then die halfway through a second save (after some files are written):
    the first checkpoint must still be whole at the path."""
    import torch.distributed.checkpoint as dcp

    import autopart.runtime.checkpoint as checkpoint

    first = autopart.parallelize(tiny_llama(seed=0), autopart.Mesh.local(), (batch[0],))
    autopart.save_checkpoint(first, checkpoint_dir)
    second = autopart.parallelize(tiny_llama(seed=1), autopart.Mesh.local(), (batch[0],))
    real_save = dcp.save

    def save_then_die(state, checkpoint_id, planner):
        real_save(state, checkpoint_id=checkpoint_id, planner=planner)
        raise _Interrupted  # the files are there, the swap never happens

    checkpoint.dcp.save = save_then_die
    try:
        autopart.save_checkpoint(second, checkpoint_dir)
    except _Interrupted:
        pass
    finally:
        checkpoint.dcp.save = real_save
    survived = _loaded(checkpoint_dir, batch)
    autopart.save_checkpoint(second, checkpoint_dir)  # a later save completes the swap
    return {
        "survived": survived,
        "first": first.full_state_dict(),
        "latest": _loaded(checkpoint_dir, batch),
        "second": second.full_state_dict(),
    }


def _loaded(checkpoint_dir, batch) -> dict:
    with autopart.init_empty_weights():
        model = tiny_llama()
    pm = autopart.parallelize(model, autopart.Mesh.local(), (batch[0],), weights=checkpoint_dir)
    return pm.full_state_dict()


@pytest.mark.slow  # another world of 2
def test_a_save_interrupted_halfway_leaves_the_previous_checkpoint_whole(tmp_path):
    checkpoint_dir = tmp_path / "ckpt"
    result = run_world(_interrupted_save, 1, str(checkpoint_dir), token_batch(8))[0]
    for key in ("survived", "latest"):
        expected = result["first" if key == "survived" else "second"]
        assert result[key].keys() == expected.keys()
        for name, tensor in expected.items():
            assert result[key][name].equal(tensor), (key, name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no .partial left
