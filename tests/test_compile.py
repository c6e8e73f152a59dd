"""`torch.compile(model, backend="autopart")`: same outputs and gradients in one
process; gradients averaged over the world in several, like DDP. With
`autopart.backend(tp=, zero=)`, tensor-parallel and ZeRO plans on dynamo's graphs
under a plain training loop, against the same loop in eager mode on one device."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

import autopart
from autopart.testing import run_world
from tests.models import MLP, VOCAB, lm_loss, make_optimizer, snapshot, tiny_llama, token_batch


def _model():
    torch.manual_seed(0)
    return MLP()


@pytest.mark.slow  # the quick suite compiles through the backend on a world of 2, below
def test_backend_is_registered_and_matches_eager():
    torch._dynamo.reset()
    model, reference = _model(), _model()
    x = torch.randn(4, 32)
    compiled = torch.compile(model, backend="autopart")
    torch.testing.assert_close(compiled(x), reference(x))
    compiled(x).square().mean().backward()
    reference(x).square().mean().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def _compiled_step(x):
    torch._dynamo.reset()
    model = _model()
    compiled = torch.compile(model, backend="autopart")
    rank = dist.get_rank()
    for _ in range(2):  # the second backward must not double-count
        model.zero_grad()
        compiled(x[rank * 2 : rank * 2 + 2]).square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_gradients_are_averaged_over_the_world():
    x = torch.randn(4, 32)
    grads = run_world(_compiled_step, 2, x)
    reference = _model()
    reference(x).square().mean().backward()
    for rank_grads in grads:
        for name, p in reference.named_parameters():
            torch.testing.assert_close(rank_grads[name], p.grad, rtol=1e-5, atol=1e-6)


class _Branchy(torch.nn.Module):
    """Control flow on the data: each rank's slice picks its own branch."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(x) if x.sum() > 0 else self.down(x)


def _divergent_step() -> str:
    torch._dynamo.reset()
    torch.manual_seed(0)
    compiled = torch.compile(_Branchy(), backend=autopart.backend(inductor=False))
    sign = 1.0 if dist.get_rank() == 0 else -1.0
    try:
        compiled(sign * torch.ones(2, 8)).square().mean().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_ranks_running_different_graphs_all_raise():
    messages = run_world(_divergent_step, 2)
    assert all("running different compiled graphs" in m for m in messages), messages


# -- beyond data parallelism: autopart.backend(mesh, tp=, zero=) ------------------------

STEPS = 3
GLOBAL_BATCH = 4
CLIP = 0.5  # below the gradients' norm: every step clips, by the whole gradient's norm


def _batches():
    return [token_batch(GLOBAL_BATCH, 16, seed=s) for s in range(STEPS)]


def _train_compiled(pins: dict, optimizer: str, accumulate: int = 1) -> dict:
    """`tiny_llama` under torch.compile with `pins`, trained by a plain loop: each rank
    feeds its replica's share of every global batch (`accumulate` backward passes per
    step, without zeroing between them); the mean loss of each step, what each rank
    holds of the parameters after training, and its gradients at the last step."""
    torch._dynamo.reset()
    model = tiny_llama()
    # Eager unless a case asks for inductor: what is checked here is the plan.
    compiled = torch.compile(model, backend=autopart.backend(**{"inductor": False, **pins}))
    opt = make_optimizer(optimizer)(model.parameters())
    tp, world = pins.get("tp", 1), dist.get_world_size()
    replica, replicas = dist.get_rank() // tp, world // tp
    losses = []
    for ids, target in _batches():
        opt.zero_grad()
        total = 0.0
        for part in range(accumulate):
            share = GLOBAL_BATCH // replicas // accumulate
            start = (replica * accumulate + part) * share
            loss = lm_loss(compiled(ids[start : start + share]), target[start : start + share])
            (loss / accumulate).backward()
            total += loss.item() / accumulate
        autopart.clip_grad_norm_(model, CLIP)  # the norm of the whole gradient, on every rank
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        mean = torch.tensor(total)
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    held = sum(p.untyped_storage().nbytes() for p in model.parameters())
    with autopart.gathered(model):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "held": held, "params": params}


def _train_eager(optimizer: str) -> dict:
    model = tiny_llama()
    opt = make_optimizer(optimizer)(model.parameters())
    losses = []
    for ids, target in _batches():
        opt.zero_grad()
        loss = lm_loss(model(ids), target)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    total = sum(p.untyped_storage().nbytes() for p in model.parameters())
    return {"losses": losses, "grads": grads, "held": total, "params": snapshot(model)}


def _several(cases: list[tuple[dict, str]]) -> list[dict]:
    return [_train_compiled(pins, optimizer) for pins, optimizer in cases]


def _assert_like_eager(got: dict, want: dict, pins: dict) -> None:
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-5), pins
    for name, param in got["params"].items():
        torch.testing.assert_close(param, want["params"][name], rtol=1e-4, atol=1e-6, msg=name)
    if pins.get("zero", 0) >= 2:  # a rank holds the gradients of what it owns only
        assert len(got["grads"]) < len(want["grads"])
    for name, grad in got["grads"].items():
        torch.testing.assert_close(grad, want["grads"][name], rtol=1e-4, atol=1e-6, msg=name)


# SGD with momentum: unlike Adam, it does not normalize away a wrong gradient scale.
QUICK = [({"zero": 3}, "sgd"), ({"tp": 2}, "sgd")]


@pytest.mark.slow  # two more compiled worlds; the quick suite compiles dp
def test_zero_and_tensor_parallel_plans_train_like_eager():
    per_rank = run_world(_several, 2, QUICK)
    reference = _train_eager("sgd")
    for results in per_rank:
        for (pins, _), got in zip(QUICK, results):
            _assert_like_eager(got, reference, pins)
    zero3 = [results[0] for results in per_rank]
    # ZeRO-3: between steps each rank holds only the parameters it owns, and together
    # they hold every parameter once.
    assert all(r["held"] < 0.75 * reference["held"] for r in zero3)
    assert sum(r["held"] for r in zero3) == reference["held"]


SLOW = [
    ({"zero": 1}, "sgd"),
    ({"zero": 2}, "adamw"),
    ({"zero": 3}, "adamw"),
    ({"zero": 2}, "adafactor"),
]
# Inductor compiling the tp program and a ZeRO-1 graph (ZeRO-3's stay eager).
INDUCTOR = [({"tp": 2, "inductor": True}, "sgd"), ({"zero": 1, "inductor": True}, "sgd")]


@pytest.mark.slow
def test_inductor_compiles_the_plans_and_trains_like_eager():
    per_rank = run_world(_several, 2, INDUCTOR)
    reference = _train_eager("sgd")
    for results in per_rank:
        for (pins, _), got in zip(INDUCTOR, results):
            _assert_like_eager(got, reference, pins)


@pytest.mark.slow
def test_every_zero_stage_trains_like_eager_for_any_optimizer():
    per_rank = run_world(_several, 2, SLOW)
    for optimizer in ("sgd", "adamw", "adafactor"):
        reference = _train_eager(optimizer)
        for results in per_rank:
            for (pins, kind), got in zip(SLOW, results):
                if kind == optimizer:
                    _assert_like_eager(got, reference, pins)


WORLD_4 = [({"tp": 2, "zero": 3}, "sgd"), ({"tp": 2, "zero": 1}, "adamw")]


@pytest.mark.slow
def test_data_and_tensor_parallel_with_zero_on_four_ranks():
    per_rank = run_world(_several, 4, WORLD_4)
    for (pins, optimizer), *results in zip(WORLD_4, *per_rank):
        reference = _train_eager(optimizer)
        for got in results:
            _assert_like_eager(got, reference, pins)


@pytest.mark.slow  # another compiled world of 2
def test_gradient_accumulation_without_zeroing_adds_up_like_eager():
    per_rank = run_world(_train_compiled, 2, {"zero": 0}, "sgd", 2)
    reference = _train_eager("sgd")
    for got in per_rank:
        assert got["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        for name, grad in got["grads"].items():
            torch.testing.assert_close(grad, reference["grads"][name], rtol=1e-4, atol=1e-6)


class _BrokenLM(torch.nn.Module):
    """A language model whose forward breaks dynamo's graph; the graph after the break
    takes the logits and a per-vocabulary scale, which is not split by sample, so it
    has no batch to plan over."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = tiny_llama()
        self.head = torch.nn.Linear(VOCAB, VOCAB)

    def forward(self, ids: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        logits = self.lm(ids).logits
        torch._dynamo.graph_break()
        return self.head(logits) * scale


def _broken_model() -> _BrokenLM:
    torch.manual_seed(0)
    return _BrokenLM()


def _train_broken(tp: int) -> dict:
    torch._dynamo.reset()
    model = _broken_model()
    compiled = torch.compile(model, backend=autopart.backend(tp=tp, inductor=False))
    opt = make_optimizer("sgd")(model.parameters())
    scale = torch.linspace(0.5, 1.5, VOCAB)
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for ids, target in _batches():
            opt.zero_grad()
            loss = lm_loss(compiled(ids, scale), target)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    messages = [str(w.message) for w in caught if "autopart" in str(w.message)]
    return {"losses": losses, "warnings": messages}


def test_graph_breaks_plan_each_graph_or_fall_back_with_one_warning():
    per_rank = run_world(_train_broken, 2, 2)
    model = _broken_model()
    opt = make_optimizer("sgd")(model.parameters())
    scale = torch.linspace(0.5, 1.5, VOCAB)
    reference = []
    for ids, target in _batches():
        opt.zero_grad()
        loss = lm_loss(model(ids, scale), target)
        loss.backward()
        opt.step()
        reference.append(loss.item())
    for got in per_rank:
        assert got["losses"] == pytest.approx(reference, rel=1e-5)
        # The model before the break is planned; the graph after it cannot be, and
        # says so once, naming the break.
        [message] = got["warnings"]
        assert "graph 2 of the compiled model (after the graph break" in message
        assert "graph_break" in message and "runs data-parallel" in message


def _feed_different_data() -> str:
    torch._dynamo.reset()
    compiled = torch.compile(tiny_llama(), backend=autopart.backend(tp=2, inductor=False))
    ids, _ = token_batch(2, 16, seed=dist.get_rank())
    try:
        compiled(ids)
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.slow  # another compiled world of 2
def test_tensor_parallel_ranks_fed_different_data_all_raise():
    messages = run_world(_feed_different_data, 2)
    assert all("tensor-parallel group fed different inputs" in m for m in messages), messages


# A process that compiled through the backend, then ends as a DDP script does: the
# graph the backend compiled must be gone before the interpreter's teardown (where a
# Gloo thread still holding a tensor aborts the process). `check` is registered before
# the backend's handler, so it runs after it.
_EXITING = """
import atexit, sys, weakref
import torch
from autopart.compile import AutopartBackend

compiled_graphs = []

class Recording(AutopartBackend):
    def __call__(self, gm, example_inputs, **kwargs):
        compiled_graphs.append(weakref.ref(gm))
        return super().__call__(gm, example_inputs, **kwargs)

def check():
    alive = sum(ref() is not None for ref in compiled_graphs)
    print(f"{len(compiled_graphs)} compiled, {alive} alive at exit")

atexit.register(check)
model = torch.compile(torch.nn.Linear(4, 4), backend=Recording(inductor=False))
model(torch.randn(2, 4)).sum().backward()
"""


def test_the_backend_releases_its_compiled_graphs_at_exit():
    job = subprocess.run(
        [sys.executable, "-c", _EXITING], capture_output=True, text=True, timeout=300
    )
    assert job.returncode == 0, job.stderr[-4000:]
    assert "1 compiled, 0 alive at exit" in job.stdout
