"""Batch normalization under a split of the batch (2 Gloo ranks): over the global batch,
a ResNet-shaped model trains as one device does on the whole batch, its running
statistics included (passes/batch_norm.py); with per-part statistics, as DDP without
SyncBatchNorm does on the same per-rank batches."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import autopart
from autopart.testing import run_world
from tests.models import assert_matches, make_optimizer, train_reference

STEPS = 3
CLASSES = 10
BATCH = 8
STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3×3 convolutions with batch norms, and a projection
    (1×1 convolution and batch norm) where the shape changes."""

    def __init__(self, w_in: int, w_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(w_in, w_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(w_out)
        self.conv2 = nn.Conv2d(w_out, w_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(w_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or w_in != w_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(w_in, w_out, 1, stride, bias=False), nn.BatchNorm2d(w_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class SmallResNet(nn.Module):
    """ResNet-18's shape for 32×32 images and 10 classes (a 3×3 stem, basic blocks,
    global pooling, a linear head), narrow and with three blocks."""

    def __init__(self, widths: tuple[int, ...] = (8, 8, 16, 16)) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()
        )
        self.blocks = nn.Sequential(
            *(
                BasicBlock(w_in, w_out, 1 if w_in == w_out else 2)
                for w_in, w_out in zip(widths, widths[1:], strict=False)
            )
        )
        self.head = nn.Linear(widths[-1], CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


def images(batch: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    # Off zero and off unit scale, so that a variance merged wrongly would show.
    pixels = torch.randn(batch, 3, 32, 32, generator=g) * 2.0 + 0.5
    return pixels, torch.randint(0, CLASSES, (batch,), generator=g)


def statistics(modules: Any) -> dict[str, torch.Tensor]:
    """The batch norms' running statistics of `modules` (named_buffers' pairs), by name
    without the stage's prefix."""
    return {
        name: b.detach().clone() for name, b in modules if name.rsplit(".", 1)[-1] in STATISTICS
    }


def _trained(pins: dict[str, Any], optimizer: str) -> dict[str, Any]:
    pixels, labels = images()
    pm = autopart.parallelize(
        SmallResNet(),
        autopart.Mesh.local(),
        (pixels,),
        loss_fn=F.cross_entropy,
        optimizer=make_optimizer(optimizer),
        **pins,
    )
    losses = [pm.train_step(pixels, labels).item() for _ in range(STEPS)]
    result = {
        "losses": losses,
        "params": pm.full_state_dict(),
        "statistics": statistics(b for stage in pm.stages for b in stage.named_buffers()),
        "plan": pm.plan,
    }
    pm.close()
    return result


def _train_cases(cases: list[tuple[dict[str, Any], str]]) -> list[dict[str, Any]]:
    return [_trained(pins, optimizer) for pins, optimizer in cases]


@functools.cache
def _one_device(optimizer: str) -> dict[str, Any]:
    return _trained_alone(optimizer, *images())


def _trained_alone(optimizer: str, pixels: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
    model = SmallResNet()
    opt = make_optimizer(optimizer)(model.parameters())
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = F.cross_entropy(model(pixels), labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {
        "losses": losses,
        "params": {k: v.detach().clone() for k, v in model.named_parameters()},
        "statistics": statistics(model.named_buffers()),
    }


@functools.cache
def _float32_spread(optimizer: str) -> dict[str, Any]:
    """How far one device's float32 run lies from itself on the same batch in another
    order (its sums taken in another order, as a split of the batch takes them): per
    loss, and per parameter and running statistic, as a norm of the difference."""
    pixels, labels = images()
    order = torch.randperm(BATCH, generator=torch.Generator().manual_seed(0))
    again, want = _trained_alone(optimizer, pixels[order], labels[order]), _one_device(optimizer)
    return {
        "losses": [abs(a - w) for a, w in zip(again["losses"], want["losses"], strict=True)],
        **{
            kind: {k: (again[kind][k].double() - w.double()).norm().item() for k, w in d.items()}
            for kind, d in (("params", want["params"]), ("statistics", want["statistics"]))
        },
    }


def assert_each_within(got: dict, want: dict, rtol: float, spread: dict | None) -> None:
    """Each loss, parameter and running statistic within `rtol` of one device's, relative
    to its size, or within float32's own spread on it (`_float32_spread`) where that is
    larger."""
    for step, (g, w) in enumerate(zip(got["losses"], want["losses"], strict=True)):
        bound = max(rtol * abs(w), spread["losses"][step] if spread else 0.0)
        assert abs(g - w) <= bound, f"step {step}: loss {g} != {w}"
    for kind in ("params", "statistics"):
        for name, w in want[kind].items():
            err = (got[kind][name].double() - w.double()).norm().item()
            norm = w.double().norm().item()
            bound = max(rtol * max(norm, 1e-12), spread[kind][name] if spread else 0.0)
            assert err <= bound, f"{name}: {err:.2e} beyond {bound:.2e} (norm {norm:.2e})"


def assert_statistics_match(got: dict, want: dict, rtol: float) -> None:
    """Every running statistic within `rtol` of the reference's, relative to its norm."""
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    for name, w in want.items():
        err = (got[name].double() - w.double()).norm().item()
        assert err <= rtol * max(w.double().norm().item(), 1e-12), f"{name}: {err:.2e}"


def _per_part_and_ddp(optimizer: str) -> dict[str, Any]:
    """Each rank's own batch (different on each) trained by autopart at dp=2 with
    per-part statistics, and by DDP without SyncBatchNorm: both sides' losses (the
    mean over the ranks), parameters and this rank's running statistics."""
    rank = dist.get_rank()
    pixels, labels = (t.chunk(2)[rank] for t in images())
    pm = autopart.parallelize(
        SmallResNet(),
        autopart.Mesh.local(),
        (pixels,),
        loss_fn=F.cross_entropy,
        optimizer=make_optimizer(optimizer),
        batch="per_rank",
        dp=2,
        per_part_statistics=True,
    )
    ours = {
        "losses": [pm.train_step(pixels, labels).item() for _ in range(STEPS)],
        "params": pm.full_state_dict(),
        "statistics": statistics(b for stage in pm.stages for b in stage.named_buffers()),
        "explain": pm.plan.explain(),
    }
    pm.close()
    ddp = DistributedDataParallel(SmallResNet())
    opt = make_optimizer(optimizer)(ddp.parameters())
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = F.cross_entropy(ddp(pixels), labels)
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / 2)
    theirs = {
        "losses": losses,
        "params": {k: v.detach().clone() for k, v in ddp.module.named_parameters()},
        "statistics": statistics(ddp.module.named_buffers()),
    }
    return {"ours": ours, "ddp": theirs}


def _world(cases: list[tuple[dict[str, Any], str]], optimizer: str) -> dict[str, Any]:
    """One world's work: `cases` over the global batch, then per-part statistics and
    DDP with `optimizer`."""
    return {"cases": _train_cases(cases), "per_part": _per_part_and_ddp(optimizer)}


# Each (pins, optimizer). The quick suite runs SGD at dp=2 with ZeRO-0 and ZeRO-3 in one
# world; the slow one ZeRO-2 and AdamW.
QUICK = [({"dp": 2, "zero": 0}, "sgd"), ({"dp": 2, "zero": 3}, "sgd")]
SLOW = [({"dp": 2, "zero": z}, "adamw") for z in (0, 2, 3)] + [({"dp": 2, "zero": 2}, "sgd")]
# Each loss, parameter and running statistic within these of one device's; under AdamW,
# or within float32's own spread on it where that is larger (`_float32_spread`): AdamW
# turns float32 rounding into steps of the learning rate's size where a gradient is near
# zero.
RTOL = {"sgd": 1e-5, "adamw": 1e-4}


@functools.cache
def _quick_world() -> list[dict[str, Any]]:
    return run_world(_world, 2, QUICK, "sgd")


def differences(got: dict[str, Any], want: dict[str, Any]) -> str:
    """The largest relative difference of the losses, of the parameters (as one vector,
    and of the worst tensor) and of any running statistic, for the record (`pytest -s`)."""
    loss = max(abs(g - w) / abs(w) for g, w in zip(got["losses"], want["losses"], strict=True))
    params = want["params"]
    err = sum((got["params"][k] - v).norm() ** 2 for k, v in params.items()) ** 0.5
    norm = sum(v.norm() ** 2 for v in params.values()) ** 0.5
    worst = max((got["params"][k] - v).norm() / max(v.norm(), 1e-12) for k, v in params.items())
    stats = max(
        ((got["statistics"][k].double() - w.double()).norm() / max(w.double().norm(), 1e-12))
        for k, w in want["statistics"].items()
        if k in got["statistics"]
    )
    return (
        f"losses {loss:.1e}, parameters {float(err / norm):.1e} (worst tensor "
        f"{float(worst):.1e}), statistics {float(stats):.1e}"
    )


def _assert_as_one_device(per_rank: list[dict[str, Any]], cases: list) -> None:
    for i, (pins, optimizer) in enumerate(cases):
        want = _one_device(optimizer)
        for rank, result in enumerate(per_rank):
            got = result["cases"][i]
            print(f"{pins}, {optimizer}, rank {rank}: {differences(got, want)}")
            assert (got["plan"].dp, got["plan"].zero) == (2, pins["zero"]), got["plan"]
            spread = _float32_spread(optimizer) if optimizer == "adamw" else None
            if spread and rank == 0:
                norms = {k: v.norm().item() for k, v in want["params"].items()}
                worst = max(e / norms[k] for k, e in spread["params"].items())
                print(f"{optimizer}: one device on the batch reordered, worst tensor {worst:.1e}")
            try:
                assert_matches(got, want, rtol=RTOL[optimizer])
                assert_each_within(got, want, RTOL[optimizer], spread)
            except AssertionError as e:
                raise AssertionError(f"{pins}, {optimizer}: rank {rank}: {e}") from e


def _assert_as_ddp(per_rank: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(per_rank):
        ours, ddp = result["per_part"]["ours"], result["per_part"]["ddp"]
        print(f"per-part statistics against DDP, rank {rank}: {differences(ours, ddp)}")
        try:
            assert_matches(ours, ddp, rtol=1e-5)
            assert_statistics_match(ours["statistics"], ddp["statistics"], 1e-5)
        except AssertionError as e:
            raise AssertionError(f"rank {rank}: {e}") from e
        assert "as DDP without SyncBatchNorm does" in ours["explain"]


def test_batch_norm_over_the_global_batch_trains_as_one_device():
    """Losses, parameters and running statistics (mean, variance, batches tracked) over
    3 SGD steps, at dp=2 with ZeRO-0 and ZeRO-3, on every rank."""
    _assert_as_one_device(_quick_world(), QUICK)


def test_per_part_statistics_train_as_ddp_without_sync_batch_norm():
    """Each replica normalizes its own part and starts each forward from the first
    replica's running statistics, as DDP (broadcast_buffers=True) does: every rank's
    running statistics are DDP's same rank's."""
    _assert_as_ddp(_quick_world())


@pytest.mark.slow
def test_batch_norm_over_the_global_batch_with_adamw_and_zero2():
    per_rank = run_world(_world, 2, SLOW, "adamw")
    _assert_as_one_device(per_rank, SLOW)
    _assert_as_ddp(per_rank)


WORLD_4 = [({"dp": 2, "tp": 2}, "sgd"), ({"dp": 2, "pp": 2}, "sgd")]


@pytest.mark.slow
def test_batch_norm_over_the_global_batch_beside_tp_and_pp_on_four_ranks():
    """tp ranks normalize the same part of the batch; a pipeline stage holds its own
    norms' running statistics, and the stages together hold all of them."""
    per_rank = run_world(_train_cases, 4, WORLD_4)
    want = _one_device("sgd")
    for i, (pins, _) in enumerate(WORLD_4):
        held: set[str] = set()
        for rank, results in enumerate(per_rank):
            got = results[i]
            mine = {k: want["statistics"][k] for k in got["statistics"]}
            try:
                assert_matches(got, want, rtol=RTOL["sgd"])
                assert_statistics_match(got["statistics"], mine, RTOL["sgd"])
            except AssertionError as e:
                raise AssertionError(f"{pins}: rank {rank}: {e}") from e
            held |= set(got["statistics"])
        assert held == set(want["statistics"]), pins


class AttentionThenNorm(nn.Module):
    """Causal self-attention over a token sequence, then a batch norm over the channels
    ([batch, channels, sequence]): context parallelism splits the sequence it
    normalizes over."""

    def __init__(self, vocab: int = 32, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, width)
        self.qkv = nn.Linear(width, 3 * width)
        self.norm = nn.BatchNorm1d(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + attended.transpose(1, 2).reshape(b, t, d)
        return self.head(self.norm(x.transpose(1, 2)).transpose(1, 2))


def _token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, 32, (4, 16), generator=g), torch.randint(0, 32, (4, 16), generator=g)


def _train_tokens(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ids, target = _tokens()
    out = []
    for pins in cases:
        pm = autopart.parallelize(
            AttentionThenNorm(),
            autopart.Mesh.local(),
            (ids,),
            loss_fn=_token_loss,
            optimizer=make_optimizer("sgd"),
            **pins,
        )
        losses = [pm.train_step(ids, target).item() for _ in range(STEPS)]
        out.append({"losses": losses, "params": pm.full_state_dict(), "plan": pm.plan})
        pm.close()
    return out


@pytest.mark.slow
def test_a_batch_norm_over_a_sequence_trains_as_one_device_under_cp_and_dp():
    """The context-parallel rewrite runs the norm on the whole sequence; dp reduces its
    statistics over the replicas."""
    cases = [{"cp": 2}, {"dp": 2}]
    ids, target = _tokens()
    model = AttentionThenNorm()
    want = train_reference(model, "sgd", STEPS, (ids,), target, _token_loss)
    for rank, results in enumerate(run_world(_train_tokens, 2, cases)):
        for pins, got in zip(cases, results, strict=True):
            assert {k: got["plan"].degrees[k] for k in pins} == pins, got["plan"]
            try:
                assert_matches(got, want, rtol=RTOL["sgd"])
            except AssertionError as e:
                raise AssertionError(f"{pins}: rank {rank}: {e}") from e
