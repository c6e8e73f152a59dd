"""`torch.compile(model, backend="autopart")`: same outputs and gradients in one
process; gradients averaged over the world in several, like DDP."""

from __future__ import annotations

import torch
import torch.distributed as dist

from autopart.testing import run_world
from tests.models import MLP


def _model():
    torch.manual_seed(0)
    return MLP()


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
    compiled = torch.compile(_Branchy(), backend="autopart")
    sign = 1.0 if dist.get_rank() == 0 else -1.0
    try:
        compiled(sign * torch.ones(2, 8)).square().mean().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_ranks_running_different_graphs_all_raise():
    messages = run_world(_divergent_step, 2)
    assert all("running different compiled graphs" in m for m in messages), messages
