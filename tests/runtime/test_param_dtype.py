"""16-bit parameters (`precision="bf16-params"`): the model computes in bf16, the optimizer
steps fp32 masters, as FSDP2 runs `MixedPrecisionPolicy(param_dtype=torch.bfloat16,
reduce_dtype=torch.float32)`. Checked against FSDP2 itself on the same world and batch:
the losses and the trained masters, and the bytes every all-gather of a forward moves.

FSDP2 runs the program autopart captured (sharded at its root) and gives the same
masters to the bit, over AdamW steps. FSDP2 over the eager model is one bf16 rounding
away: torch.export's program computes some gradients in another order than eager
autograd (a unit in bf16's last place here and there, measured on this model), which
AdamW turns into update-sized differences on near-zero gradients; so against eager
FSDP2 the losses are compared, at bf16's resolution."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autopart
from autopart.capture import capture
from autopart.testing import run_world
from tests.harness import parallelize_lm, train_losses
from tests.models import lm_loss, make_optimizer, tiny_llama, token_batch

STEPS = 3


class GatheredBytes:
    """Counts the bytes every `dist.all_gather_single` (ZeRO-3's and FSDP2's gathers)
    writes on this rank while it is installed."""

    def __init__(self) -> None:
        self.total = 0
        self._original = dist.all_gather_single

    def __enter__(self) -> GatheredBytes:
        def counted(output: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.total += output.numel() * output.element_size()
            return self._original(output, *args, **kwargs)

        dist.all_gather_single = counted
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_gather_single = self._original


def _autopart(pins: dict[str, Any]) -> dict[str, Any]:
    batch = token_batch()
    pm = parallelize_lm(tiny_llama(), batch, "adamw", **pins)
    with GatheredBytes() as gathered, torch.no_grad():
        pm(batch[0])  # a forward gathers each bucket once
    out = {
        "losses": train_losses(pm, batch, STEPS),
        "params": pm.full_state_dict(),
        "forward_gathers": gathered.total,
    }
    pm.close()
    return out


def _exported(model: nn.Module, ids: torch.Tensor) -> nn.Module:
    """`model` as autopart captures it (torch.export over bf16 parameters), holding its
    own fp32 parameters again: the program autopart runs, before its rewrites."""
    return capture(model, (ids,), param_dtype=torch.bfloat16).gm


def _fsdp2(exported: bool = False) -> dict[str, Any]:
    """FSDP2 on the same world: each rank trains on its half of the global batch. Per
    block and at the root over the model; over its exported program (`exported`), at
    the root alone (the program has no blocks to hook)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = tiny_llama()
    ids, target = token_batch()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if exported:
        model = _exported(model, ids)
    else:
        for block in model.model.layers:
            fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = make_optimizer("adamw")(model.parameters())
    share, rank = ids.shape[0] // dist.get_world_size(), dist.get_rank()
    mine = slice(rank * share, (rank + 1) * share)
    with GatheredBytes() as gathered, torch.no_grad():
        model(ids[mine])
    losses = []
    for _ in range(STEPS):
        loss = lm_loss(model(ids[mine]), target[mine])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().float()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "forward_gathers": gathered.total}


def _compare(pins: dict[str, Any]) -> dict[str, Any]:
    return {"autopart": _autopart(pins), "fsdp2": _fsdp2(exported=True), "eager": _fsdp2()}


def _assert_close(got: dict, want: dict, rtol: float = 1e-6) -> None:
    for step, (a, b) in enumerate(zip(got["losses"], want["losses"], strict=True)):
        assert abs(a - b) <= rtol * abs(b), f"step {step}: loss {a} != FSDP2's {b}"
    assert got["params"].keys() == want["params"].keys()
    for name, w in want["params"].items():
        g = got["params"][name]
        assert g.dtype == torch.float32, f"{name}: the masters are fp32, not {g.dtype}"
        err = float((g - w).norm() / w.norm())
        assert err <= rtol, f"{name}: {err:.2e} from FSDP2's"


@pytest.mark.parametrize(
    "pins",
    [
        # The quick suite counts what ZeRO-3 gathers against FSDP2's.
        pytest.param({"dp": 2, "zero": 3}, marks=pytest.mark.slow),
        pytest.param({"dp": 2, "zero": 2}, marks=pytest.mark.slow),
        pytest.param({"dp": 2, "zero": 1}, marks=pytest.mark.slow),
    ],
    ids=str,
)
def test_sixteen_bit_parameters_match_fsdp2(pins: dict[str, Any]) -> None:
    rank0 = run_world(_compare, 2, {"precision": "bf16-params", **pins})[0]
    _assert_close(rank0["autopart"], rank0["fsdp2"])
    bf16_resolution = 2.0**-7
    for got, eager in zip(rank0["autopart"]["losses"], rank0["eager"]["losses"], strict=True):
        assert abs(got - eager) <= bf16_resolution * abs(eager)


def _forward_gathers(precision: str) -> int:
    batch = token_batch()
    pm = parallelize_lm(tiny_llama(), batch, "adamw", precision=precision, dp=2, zero=3)
    with GatheredBytes() as gathered, torch.no_grad():
        pm(batch[0])
    pm.close()
    return gathered.total


def _gathers_by_precision() -> dict[str, Any]:
    return {
        "bf16-mixed": _forward_gathers("bf16-mixed"),
        "bf16-params": _forward_gathers("bf16-params"),
        "fsdp2": _fsdp2()["forward_gathers"],
    }


def test_zero3_gathers_half_of_autocast_and_what_fsdp2_gathers() -> None:
    """Every dim of the tiny Llama is even: neither side pads, so the bytes are equal."""
    counts = run_world(_gathers_by_precision, 2)[0]
    assert counts["bf16-params"] * 2 == counts["bf16-mixed"]
    assert counts["bf16-params"] == counts["fsdp2"]


def _one_device(steps: int) -> dict[str, Any]:
    """One device running the program autopart captured, as "bf16-params" runs it: bf16
    parameters and inputs, SGD over fp32 masters, on the global batch."""
    model = tiny_llama()
    ids, target = token_batch()
    program = _exported(model, ids)
    params = dict(program.named_parameters())
    masters = {n: p.detach().clone().requires_grad_() for n, p in params.items()}
    optimizer = make_optimizer("sgd")(masters.values())
    losses = []
    for _ in range(steps):
        with torch.no_grad():
            for n, p in params.items():
                p.data = masters[n].detach().to(torch.bfloat16)
        loss = lm_loss(program(ids), target)
        loss.backward()
        for n, p in params.items():
            masters[n].grad = p.grad.float()
            p.grad = None
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: m.detach() for n, m in masters.items()}}


def _autopart_sgd(pins: dict[str, Any]) -> dict[str, Any]:
    batch = token_batch()
    pm = parallelize_lm(tiny_llama(), batch, "sgd", precision="bf16-params", **pins)
    out = {"losses": train_losses(pm, batch, STEPS), "params": pm.full_state_dict()}
    pm.close()
    return out


@pytest.mark.parametrize(
    "pins",
    [
        pytest.param({"tp": 2}, marks=pytest.mark.slow),
        pytest.param({"pp": 2, "microbatches": 2, "schedule": "1f1b"}, marks=pytest.mark.slow),
        pytest.param({"dp": 2, "zero": 3, "microbatches": 2}, marks=pytest.mark.slow),
    ],
    ids=str,
)
def test_sixteen_bit_parameters_track_one_device(pins: dict[str, Any]) -> None:
    """Under tp and pp the sums run in bf16 in another order (row-parallel partial
    products, microbatches), so the runs agree to bf16's rounding, not to the bit: SGD's
    updates within 3% of their size, where a gradient scaled wrong by 2 is off by 100%;
    the losses within two units of bf16's last place, each part's loss being rounded to
    bf16 before their mean."""
    got = run_world(_autopart_sgd, 2, pins)[0]
    want = _one_device(STEPS)
    init = dict(tiny_llama().named_parameters())
    for step, (a, b) in enumerate(zip(got["losses"], want["losses"], strict=True)):
        assert abs(a - b) <= 2.0**-6 * abs(b), f"step {step}: loss {a} != {b}"
    for name, w in want["params"].items():
        update = (w - init[name].detach()).norm()
        err = float((got["params"][name] - w).norm() / update)
        assert err <= 0.03, f"{name}: {err:.1%} of its update from one device's"


def _resumed(path: str) -> dict[str, Any]:
    """Two steps at ZeRO-1, saved; two more at ZeRO-3 from a model with other weights
    that only the checkpoint can make right; and four steps at ZeRO-3 without a stop."""
    batch = token_batch()
    pins = {"precision": "bf16-params", "dp": 2}
    first = parallelize_lm(tiny_llama(seed=0), batch, "adamw", zero=1, **pins)
    losses = train_losses(first, batch, 2)
    autopart.save_checkpoint(first, path)
    first.close()
    second = parallelize_lm(tiny_llama(seed=1), batch, "adamw", zero=3, **pins)
    autopart.load_checkpoint(second, path)
    losses += train_losses(second, batch, 2)
    resumed = {"losses": losses, "params": second.full_state_dict()}
    second.close()
    whole = parallelize_lm(tiny_llama(seed=0), batch, "adamw", zero=3, **pins)
    straight = {"losses": train_losses(whole, batch, 4), "params": whole.full_state_dict()}
    whole.close()
    return {"resumed": resumed, "straight": straight}


@pytest.mark.slow  # another world of 2
def test_a_checkpoint_keeps_the_fp32_masters(tmp_path) -> None:
    """The checkpoint holds the masters, not their bf16 copies: a run resumed from it,
    under another ZeRO stage, goes on as if it had not stopped."""
    rank0 = run_world(_resumed, 2, str(tmp_path))[0]
    _assert_close(rank0["resumed"], rank0["straight"])
