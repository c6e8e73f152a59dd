"""Master weights on the host (`master_weights="host"`): the fp32 weights live beside
the offloaded optimizer state, the device holds bf16 copies, and a step matches one
device doing the same (fp32 masters, bf16 weights read as autopart's graph reads them,
bf16 gradients): the first forward exactly, the updates within what reducing bf16
gradients over ranks and microbatches rounds.

SGD with momentum. The updates are compared, not only the weights: three steps move
the weights by little, so the weights alone would agree with a run that lost most of
an update to bf16 rounding (which the fp32 masters exist to prevent)."""

from __future__ import annotations

import pytest
import torch
from torch import fx

import autopart
from autopart.testing import run_world
from tests.harness import parallelize_lm, train_losses
from tests.models import (
    LM_FACTORIES,
    MLP,
    FixedLengthLM,
    snapshot,
    tiny_llama,
    token_batch,
    train_host_masters_reference,
)

STEPS = 3
MODELS = {**LM_FACTORIES, "fixed-length": FixedLengthLM}
QUICK = [("llama", {"dp": 2, "zero": 2, "microbatches": 2}), ("llama", {"tp": 2})]
SLOW = [
    ("llama", {"dp": 2, "zero": 1}),
    ("llama", {"dp": 2, "zero": 3}),
    ("llama", {"pp": 2, "microbatches": 2}),
    ("gpt2", {"pp": 2, "microbatches": 2}),  # the head reads the embedding: a tied weight
]


def _train(batches, cases) -> dict:
    out = {}
    for name, pins in cases:
        model = MODELS[name]()
        pm = parallelize_lm(
            model, batches[0], "sgd", precision="bf16-mixed", master_weights="host", **pins
        )
        assert pm.plan.offload  # master weights on the host imply it
        trained = [p for p in pm.parameters() if p.requires_grad]
        stepped = [p for group in pm.optimizer.param_groups for p in group["params"]]
        losses = [pm.train_step(ids, target).item() for ids, target in batches]
        graphs = [getattr(program.runner, "program", None) for program in pm.programs.programs]
        widening = torch.ops.aten.to.dtype
        out[f"{name} {pins}"] = {
            "losses": losses,
            "programs": len(graphs),
            # What each program (without a pipeline) widens the weights to.
            "widened": [
                {n.args[1] for n in g.graph.find_nodes(op="call_function", target=widening)}
                for g in graphs
                if isinstance(g, fx.GraphModule)
            ],
            "params": pm.full_state_dict(),
            "device": {p.dtype for p in trained},
            "host": {p.dtype for p in stepped} | {p.device.type for p in stepped},
        }
        pm.close()
        # The model's own parameters are fp32 again (a ZeRO-1/2 replica's hold the
        # bf16 copies' values; full_state_dict has the masters).
        out[f"{name} {pins}"]["closed"] = {p.dtype for p in model.parameters()}
    return out


def _update_error(got: dict, want: dict, before: dict) -> float:
    """How far `got`'s update is from `want`'s, relative to `want`'s (all tensors as
    one vector)."""
    err = sum(((got[n] - want[n]) ** 2).sum() for n in want) ** 0.5
    moved = sum(((want[n] - before[n]) ** 2).sum() for n in want) ** 0.5
    return float(err / moved)


def _check(cases: list, batches: list) -> list[int]:
    """Check every case on every rank; the programs each rank made, summed over cases."""
    references = {
        name: train_host_masters_reference(MODELS[name], batches) for name in {n for n, _ in cases}
    }
    made = []
    for rank, results in enumerate(run_world(_train, 2, batches, cases)):
        made.append(sum(result["programs"] for result in results.values()))
        for name, pins in cases:
            result, reference = results[f"{name} {pins}"], references[name]
            where = (name, pins, rank)
            assert result["device"] == {torch.bfloat16}, where
            assert result["host"] == {torch.float32, "cpu"}, where
            assert result["closed"] == {torch.float32}, where
            assert all(w == {torch.float32} for w in result["widened"]), where
            params = result["params"]
            assert params.keys() == reference["params"].keys(), where
            assert {v.dtype for v in params.values()} == {torch.float32}, where
            # The masters keep what bf16 would round away.
            assert any((v.bfloat16().float() != v).any() for v in params.values()), where
            losses, want = result["losses"], reference["losses"]
            # Only row-parallel partial sums (tp) round the first forward differently.
            first = 1e-4 if pins.get("tp") else 1e-6
            assert losses[0] == pytest.approx(want[0], rel=first), where
            assert losses == pytest.approx(want, rel=1e-4), where
            before = snapshot(MODELS[name]())
            assert _update_error(params, reference["params"], before) < 0.02, where
    return made


@pytest.mark.slow  # a world of 2; the host masters' refusals are checked quick
def test_host_masters_train_like_one_device_over_fp32_masters():
    _check(QUICK, [token_batch(8)] * STEPS)


@pytest.mark.slow  # four more plans in a world of 2
def test_host_masters_under_zero1_zero3_and_pipelines():
    _check(SLOW, [token_batch(8)] * STEPS)


@pytest.mark.slow  # another world of 2
def test_a_program_made_again_for_new_shapes_reads_the_weights_as_the_first():
    """A step at another sequence length runs a program captured again from the model
    (whose length torch.export keeps static), its parameters the bf16 copies by then:
    captured as fp32 all the same, so its norms read the weights widened."""
    batches = [token_batch(8), token_batch(8, seq=24), token_batch(8)]
    programs = _check([("fixed-length", {"dp": 2, "zero": 1})], batches)
    assert programs == [2, 2]  # on each rank: the first, and one for length 24


def _resume(root, batch) -> dict:
    """Save under ZeRO-2 with host masters; load into plain fp32 tp=2 and into ZeRO-3
    with host masters: each holds the saved masters, exactly."""
    saver = parallelize_lm(
        tiny_llama(seed=0), batch, "sgd", precision="bf16-mixed", master_weights="host",
        dp=2, zero=2,
    )  # fmt: skip
    train_losses(saver, batch, 2)
    saved = saver.full_state_dict()
    autopart.save_checkpoint(saver, root)
    saver.close()
    out = {}
    for name, pins in (
        ("fp32", {"tp": 2}),
        ("zero3", {"dp": 2, "zero": 3, "precision": "bf16-mixed", "master_weights": "host"}),
    ):
        pm = parallelize_lm(tiny_llama(seed=1), batch, "sgd", **pins)
        autopart.load_checkpoint(pm, root)
        loaded = pm.full_state_dict()
        out[name] = loaded.keys() == saved.keys() and all(
            torch.equal(loaded[n], saved[n]) for n in saved
        )
        pm.close()
    return out


@pytest.mark.slow  # a world of 2 saving once and loading twice
def test_a_checkpoint_saves_the_host_masters_not_the_device_copies(tmp_path):
    batch = token_batch(8)
    for rank, result in enumerate(run_world(_resume, 2, str(tmp_path / "ckpt"), batch)):
        assert result == {"fp32": True, "zero3": True}, rank


def test_host_masters_need_offload_and_a_mixed_precision():
    x = torch.randn(4, 32)  # a small MLP: the pins are what is refused
    mesh = autopart.Mesh.cluster("cpu", nodes=1, per_node=2)
    for pins in ({"precision": "fp32"}, {"precision": "bf16-mixed", "offload": False}):
        with pytest.raises(autopart.PlanError, match="master_weights='host'"):
            autopart.plan(MLP(), mesh, (x,), master_weights="host", **pins)
