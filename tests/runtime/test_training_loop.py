"""The training loop around `train_step`, against one device doing the same with plain
PyTorch: clipping by the global norm, per-rank batches as DDP takes them, a step with a
non-finite loss, and inputs that break the batch convention."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import autopart
from autopart.runtime.training import ConventionMismatch, NonFiniteLoss
from autopart.testing import run_world
from tests.harness import case_key, parallelize_lm
from tests.models import (
    LM_FACTORIES,
    assert_matches,
    lm_loss,
    make_optimizer,
    snapshot,
    tiny_llama,
    tiny_mixtral,
    token_batch,
)

STEPS = 3
MAX_NORM = 0.5  # below every step's norm here: each step clips


MODELS = {"llama": tiny_llama, "mixtral": tiny_mixtral}


def _clipped_reference(batch, name: str = "llama", steps: int = STEPS) -> dict:
    """One device: torch.nn.utils.clip_grad_norm_ before each SGD step."""
    model = MODELS[name]()
    opt = make_optimizer("sgd")(model.parameters())
    ids, target = batch
    losses, norms = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = lm_loss(model(ids), target)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": snapshot(model), "norms": norms}


def _train_clipped(cases, batch, name: str = "llama") -> dict:
    results = {}
    for pins in cases:
        pm = parallelize_lm(MODELS[name](), batch, "sgd", max_grad_norm=MAX_NORM, **pins)
        ids, target = batch
        losses, norms = [], []
        for _ in range(STEPS):
            losses.append(pm.train_step(ids, target).item())
            norms.append(pm.grad_norm)
        results[case_key(name, pins)] = {
            "losses": losses,
            "norms": norms,
            "params": pm.full_state_dict(),
        }
        pm.close()
    return results


CLIPPED = [
    {"dp": 2, "zero": 2},
    pytest.param({"tp": 2}, marks=pytest.mark.slow),
    pytest.param({"dp": 2, "zero": 0}, marks=pytest.mark.slow),
    pytest.param({"dp": 2, "zero": 1}, marks=pytest.mark.slow),
    pytest.param({"dp": 2, "zero": 3}, marks=pytest.mark.slow),
    pytest.param({"pp": 2, "microbatches": 2}, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("pins", CLIPPED, ids=lambda p: ",".join(f"{k}{v}" for k, v in p.items()))
def test_clipped_training_matches_one_device(pins):
    """The global norm counts every element once, whatever the plan shards or
    replicates, and each step scales the gradients as clip_grad_norm_ does."""
    batch = token_batch(batch=8)
    reference = _clipped_reference(batch)
    assert all(n > MAX_NORM for n in reference["norms"]), "every step must clip"
    for rank, results in enumerate(run_world(_train_clipped, 2, [pins], batch)):
        got = results[case_key("llama", pins)]
        assert_matches(got, reference)
        for step, (norm, want) in enumerate(zip(got["norms"], reference["norms"], strict=True)):
            assert abs(norm - want) <= 1e-5 * want, f"rank {rank} step {step}: {norm} != {want}"


@pytest.mark.slow
def test_clipped_composition_matches_one_device():
    """dp × tp × ZeRO-1 on 4 ranks: replicated norms' weights counted once over tp,
    flat shards once over dp."""
    pins = {"dp": 2, "tp": 2, "zero": 1}
    batch = token_batch(batch=8)
    reference = _clipped_reference(batch)
    for results in run_world(_train_clipped, 4, [pins], batch):
        got = results[case_key("llama", pins)]
        assert_matches(got, reference)
        assert got["norms"] == pytest.approx(reference["norms"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "pins", "seq"),
    [("llama", {"cp": 2}, 32), ("mixtral", {"ep": 2}, 16), ("mixtral", {"ep": 2, "zero": 1}, 16)],
    ids=["cp2", "ep2", "ep2,zero1"],
)
def test_clipped_training_under_cp_and_ep_matches_one_device(name, pins, seq):
    """Under cp each rank holds a part of the replicated weights' gradient until the
    sync sums it; under ep each rank holds its own experts: counted once each."""
    batch = token_batch(batch=8, seq=seq)
    reference = _clipped_reference(batch, name)
    assert all(n > MAX_NORM for n in reference["norms"]), "every step must clip"
    for results in run_world(_train_clipped, 2, [pins], batch, name):
        got = results[case_key(name, pins)]
        assert_matches(got, reference)
        assert got["norms"] == pytest.approx(reference["norms"], rel=1e-5)


def _nan_loss(output, target: torch.Tensor) -> torch.Tensor:
    """The language-model loss, NaN where the first target token is -100 (which the
    cross-entropy ignores)."""
    poisoned = (target == -100).any()
    return lm_loss(output, target) + torch.where(poisoned, float("nan"), 0.0)


def _optimizer_tensors(pm: autopart.ParallelModule) -> list[torch.Tensor]:
    assert pm.optimizer is not None
    return [
        v.clone()
        for state in pm.optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    ]


def _train_through_nan(pins, skip: bool, batch) -> dict:
    ids, target = batch
    poisoned = target.clone()
    poisoned[-1, 0] = -100  # in the last rank's share of the batch
    pm = autopart.parallelize(
        LM_FACTORIES["llama"](),
        autopart.Mesh.local(),
        (ids,),
        loss_fn=_nan_loss,
        optimizer=make_optimizer("adamw"),
        skip_nonfinite=skip,
        **pins,
    )
    pm.train_step(ids, target)
    params, moments = pm.full_state_dict(), _optimizer_tensors(pm)
    raised = None
    try:
        loss = pm.train_step(ids, poisoned)
    except NonFiniteLoss as e:
        raised, loss = e.step, torch.tensor(e.loss)
    after = pm.full_state_dict()
    unchanged = all(torch.equal(after[k], v) for k, v in params.items()) and all(
        torch.equal(a, b) for a, b in zip(_optimizer_tensors(pm), moments, strict=True)
    )
    next_loss = pm.train_step(ids, target).item()  # training goes on after the bad step
    result = {
        "raised": raised,
        "nan": bool(loss.isnan()),
        "unchanged": unchanged,
        "skipped": pm.skipped_steps,
        "next_finite": bool(torch.isfinite(torch.tensor(next_loss))),
    }
    pm.close()
    return result


NAN_PLANS = [
    {"dp": 2, "zero": 2},
    pytest.param({"dp": 2, "zero": 0}, marks=pytest.mark.slow),
    pytest.param({"dp": 2, "zero": 1}, marks=pytest.mark.slow),
    pytest.param({"dp": 2, "zero": 3}, marks=pytest.mark.slow),
    pytest.param({"tp": 2}, marks=pytest.mark.slow),
    pytest.param({"pp": 2, "microbatches": 2}, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("pins", NAN_PLANS, ids=lambda p: ",".join(f"{k}{v}" for k, v in p.items()))
def test_a_nan_step_leaves_the_weights_and_raises(pins):
    """A NaN loss on one rank's share reaches no weight and no optimizer state; every
    rank raises NonFiniteLoss naming the step, or, with skip_nonfinite, counts it."""
    batch = token_batch(batch=8)
    for result in run_world(_train_through_nan, 2, pins, False, batch):
        assert result == {
            "raised": 2,
            "nan": True,
            "unchanged": True,
            "skipped": 0,
            "next_finite": True,
        }
    for result in run_world(_train_through_nan, 2, pins, True, batch):
        assert result["raised"] is None and result["unchanged"] and result["skipped"] == 1


@pytest.mark.slow
def test_a_nan_step_under_a_composition_leaves_the_weights_and_raises():
    batch = token_batch(batch=8)
    pins = {"dp": 2, "tp": 2, "zero": 1}
    for result in run_world(_train_through_nan, 4, pins, False, batch):
        assert result["raised"] == 2 and result["unchanged"] and result["next_finite"]


def _per_rank_against_ddp(pins, batches) -> dict:
    """Each rank passes its own share of each global batch, to autopart and to DDP."""
    rank, world = dist.get_rank(), dist.get_world_size()
    shares = [(ids.chunk(world)[rank], target.chunk(world)[rank]) for ids, target in batches]
    ddp = DistributedDataParallel(LM_FACTORIES["llama"]())
    opt = make_optimizer("adamw")(ddp.parameters())
    ddp_losses = []
    for ids, target in shares:
        opt.zero_grad()
        loss = lm_loss(ddp(ids), target)
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        ddp_losses.append(mean.item() / world)
    pm = autopart.parallelize(
        LM_FACTORIES["llama"](),
        autopart.Mesh.local(),
        (batches[0][0],),
        loss_fn=lm_loss,
        optimizer=make_optimizer("adamw"),
        batch="per_rank",
        **pins,
    )
    losses = [pm.train_step(ids, target).item() for ids, target in shares]
    result = {
        "autopart": {"losses": losses, "params": pm.full_state_dict()},
        "ddp": {"losses": ddp_losses, "params": snapshot(ddp.module)},
    }
    pm.close()
    return result


PER_RANK = [
    {"dp": 2, "zero": 1},
    pytest.param({"dp": 2, "zero": 0}, marks=pytest.mark.slow),
    pytest.param({"dp": 2, "zero": 2}, marks=pytest.mark.slow),
    pytest.param({"dp": 2, "zero": 3}, marks=pytest.mark.slow),
    pytest.param({"dp": 2, "microbatches": 2}, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("pins", PER_RANK, ids=lambda p: ",".join(f"{k}{v}" for k, v in p.items()))
def test_per_rank_batches_match_ddp(pins):
    batches = [token_batch(batch=8, seed=s) for s in (1, 2, 3)]
    for result in run_world(_per_rank_against_ddp, 2, pins, batches):
        assert_matches(result["autopart"], result["ddp"])


def _per_rank_under_tp_and_dp(batches) -> dict:
    """dp × tp on 4 ranks, per rank: the two tp ranks of each dp rank pass its share."""
    mesh = autopart.Mesh.local()
    pm = autopart.parallelize(
        LM_FACTORIES["llama"](),
        mesh,
        (batches[0][0],),
        loss_fn=lm_loss,
        optimizer=make_optimizer("adamw"),
        batch="per_rank",
        dp=2,
        tp=2,
    )
    share, shares = pm.groups.batch_rank, pm.groups.batch_size
    losses = [
        pm.train_step(ids.chunk(shares)[share], target.chunk(shares)[share]).item()
        for ids, target in batches
    ]
    result = {"losses": losses, "params": pm.full_state_dict()}
    pm.close()
    return result


@pytest.mark.slow
def test_per_rank_batches_under_a_composition_match_one_device():
    batches = [token_batch(batch=8, seed=s) for s in (1, 2, 3)]
    model = LM_FACTORIES["llama"]()
    opt = make_optimizer("adamw")(model.parameters())
    losses = []
    for ids, target in batches:
        opt.zero_grad()
        loss = lm_loss(model(ids), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    reference = {"losses": losses, "params": snapshot(model)}
    for result in run_world(_per_rank_under_tp_and_dp, 4, batches):
        assert_matches(result, reference)


def _ignored_per_rank(batch) -> dict:
    """Ignored tokens fall unevenly over the ranks' shares: the step's loss is still the
    mean over every counted token of the global batch, as on one device."""
    rank = dist.get_rank()
    ids, target = batch
    pm = autopart.parallelize(
        LM_FACTORIES["llama"](),
        autopart.Mesh.local(),
        (ids,),
        loss_fn=lambda out, t: F.cross_entropy(out.logits.flatten(0, 1), t.flatten()),
        optimizer=make_optimizer("sgd"),
        batch="per_rank",
        dp=2,
    )
    share = (ids.chunk(2)[rank], target.chunk(2)[rank])
    result = {"losses": [pm.train_step(*share).item() for _ in range(2)]}
    result["params"] = pm.full_state_dict()
    pm.close()
    return result


@pytest.mark.slow  # test_ignored_tokens.py's quick case counts them
def test_per_rank_batches_weigh_ignored_tokens_as_one_device():
    ids, target = token_batch(batch=8)
    target = target.clone()
    target[:3, 2:] = -100  # most of the first rank's tokens are ignored
    model = LM_FACTORIES["llama"]()
    opt = make_optimizer("sgd")(model.parameters())
    losses = []
    for _ in range(2):
        opt.zero_grad()
        loss = lm_loss(model(ids), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    reference = {"losses": losses, "params": snapshot(model)}
    for result in run_world(_ignored_per_rank, 2, (ids, target)):
        assert_matches(result, reference)


def _break_convention(convention: str, batch) -> str:
    rank = dist.get_rank()
    ids, target = batch
    pm = autopart.parallelize(
        LM_FACTORIES["llama"](),
        autopart.Mesh.local(),
        (ids,),
        loss_fn=lm_loss,
        optimizer=make_optimizer("sgd"),
        batch=convention,
        dp=2,
    )
    if convention == "global":  # each rank passes its own share, as under DDP
        ids, target = ids.chunk(2)[rank], target.chunk(2)[rank]
    before = pm.full_state_dict()
    try:
        pm.train_step(ids, target)
    except ConventionMismatch as e:
        unchanged = all(torch.equal(v, before[k]) for k, v in pm.full_state_dict().items())
        pm.close()
        return f"{unchanged}: {e}"
    pm.close()
    return "no error"


@pytest.mark.slow  # a world that fails on purpose; the quick suite's NaN step raises too
@pytest.mark.parametrize("convention", ["per_rank", "global"])
def test_a_broken_batch_convention_raises_on_every_rank(convention):
    """batch='global' fed per-rank shares, and batch='per_rank' fed the global batch on
    every rank: every rank raises, naming the convention, before the step reaches the
    weights."""
    messages = run_world(_break_convention, 2, convention, token_batch(batch=8))
    for message in messages:
        assert message.startswith("True: step 1:"), message
        assert f"batch='{convention}'" in message


def test_clip_grad_norm_names_the_supported_way_for_a_parallel_module():
    """A ParallelModule's gradients are final only inside its step: the public helper
    refuses it and names max_grad_norm."""
    pm = object.__new__(autopart.ParallelModule)
    with pytest.raises(TypeError, match="max_grad_norm"):
        autopart.clip_grad_norm_(pm, 1.0)


def _break_per_rank_under_tp() -> str:
    """dp × tp, per rank: the two tp ranks of one dp rank pass different batches."""
    ids, target = token_batch(batch=4, seed=1 + dist.get_rank())
    pm = autopart.parallelize(
        LM_FACTORIES["llama"](),
        autopart.Mesh.local(),
        (token_batch(batch=8)[0],),
        loss_fn=lm_loss,
        optimizer=make_optimizer("sgd"),
        batch="per_rank",
        dp=2,
        tp=2,
    )
    try:
        pm.train_step(ids, target)
    except ConventionMismatch as e:
        return str(e)
    finally:
        pm.close()
    return "no error"


@pytest.mark.slow
def test_per_rank_batches_must_agree_within_a_tensor_parallel_group():
    for message in run_world(_break_per_rank_under_tp, 4):
        assert "must pass the same batch" in message, message
