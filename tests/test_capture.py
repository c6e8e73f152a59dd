"""Capture: export and fx front ends, meta device, FQNs, module paths, clear failures."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.export import Dim

from autopart.capture import CaptureError, capture
from autopart.passes import MODULE_PATH, analyze
from tests.models import MLP, ConvNet, llama3_8b_on_meta, tiny_gpt2, tiny_llama, token_batch


def _every_node_has_val(gm) -> bool:
    """Every operator has a `val`, a FakeTensor wherever it yields a tensor."""
    ops = [
        n
        for n in gm.graph.nodes
        if n.op in ("call_function", "call_module") and n.target != "_guards_fn"
    ]
    return all("val" in n.meta for n in ops) and any(
        isinstance(n.meta["val"], torch._subclasses.FakeTensor) for n in ops
    )


@pytest.mark.parametrize(
    "build, inputs",
    [
        (tiny_gpt2, lambda: (token_batch(4)[0],)),
        (tiny_llama, lambda: (token_batch(4)[0],)),
        (MLP, lambda: (torch.randn(4, 32),)),
        (ConvNet, lambda: (torch.randn(4, 3, 16, 16),)),
    ],
)
def test_captures_models_with_values_fqns_and_module_paths(build, inputs):
    model = build()
    inputs = inputs()
    captured = capture(model, inputs)
    assert captured.frontend == "export"
    assert _every_node_has_val(captured.gm)
    # Parameters keep their FQNs and are the model's own tensors (trained in place).
    for name, p in model.named_parameters():
        assert captured.gm.get_parameter(name) is p
    analyze(captured.gm, captured.context())
    paths = {MODULE_PATH.get(n) for n in captured.gm.graph.nodes if n.op == "call_function"}
    module_names = {name for name, _ in model.named_modules()}
    assert paths - {""} and paths <= module_names
    out, ref = captured.gm(*inputs), model(*inputs)
    out, ref = (getattr(x, "logits", x) for x in (out, ref))
    torch.testing.assert_close(out, ref)


def test_capture_on_meta_device():
    with torch.device("meta"):
        model = tiny_llama(layers=3)
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    captured = capture(model, (ids,))
    assert _every_node_has_val(captured.gm)
    vals = [n.meta["val"] for n in captured.gm.graph.nodes if n.op == "call_function"]
    assert all(v.device.type == "meta" for v in vals if isinstance(v, torch.Tensor))


def test_batch_and_sequence_dims_are_dynamic_by_default_and_named_dims_follow_user_dims():
    ids = token_batch(4)[0]
    captured = capture(tiny_gpt2(), (ids,))
    assert set(captured.dims) == {"batch", "seq"}  # dim 1 of token ids is the sequence
    assert captured.dim_ranges["seq"] == (2, 64)  # at most GPT-2's n_positions
    assert captured.admits_batch(2) and captured.admits_batch(64)
    named = capture(tiny_gpt2(), (ids,), dynamic_shapes=({0: Dim("batch"), 1: Dim("seq", max=64)},))
    assert set(named.dims) == {"batch", "seq"}


class Options:
    def __init__(self, scale: float):
        self.scale = scale


class TakesOptions(nn.Module):
    """Export cannot take an argument of an unregistered class; fx.symbolic_trace can."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, options: Options):
        return torch.relu(self.fc(x)) * options.scale


def test_symbolic_trace_takes_what_export_cannot():
    model = TakesOptions()
    x = torch.randn(4, 8)
    captured = capture(model, (x, Options(2.0)))
    assert captured.frontend == "symbolic_trace"
    assert _every_node_has_val(captured.gm)
    torch.testing.assert_close(captured.gm(x, Options(3.0)), model(x, Options(3.0)))
    analyze(captured.gm, captured.context())
    assert {MODULE_PATH.get(n) for n in captured.gm.graph.nodes} >= {"fc"}


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:  # a branch on a tensor's value
            return self.fc(x)
        return x


def test_uncapturable_model_names_construct_line_and_fix():
    with pytest.raises(CaptureError) as info:
        capture(DataDependent(), (torch.randn(4, 8),))
    message = str(info.value)
    assert "DataDependent" in message
    assert "control flow depends on a tensor's values" in message
    assert "test_capture.py" in message and "if x.sum() > 0" in message
    assert "torch.cond" in message


@pytest.mark.slow  # a whole 8B trace; the quick suite captures tiny models on meta
def test_llama3_8b_config_captures_on_meta():
    model = llama3_8b_on_meta()
    ids = torch.zeros(1, 8192, dtype=torch.long, device="meta")
    captured = capture(model, (ids,))
    params = sum(p.numel() for p in captured.gm.parameters())
    assert 8.0e9 < params < 8.1e9


class _VarargsWrapper(nn.Module):
    """A common adapter for training loops: `forward(self, *args)`."""

    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_llama()

    def forward(self, *args):
        return self.model(*args).logits


def test_the_batch_is_dynamic_in_any_signature():
    """Dynamic-batch specs follow `forward`'s own parameters: `*args`, keyword inputs
    given as `example_kwargs`, and inputs given as a list all capture with a dynamic
    batch."""
    ids = token_batch(4)[0]
    cases = [
        (_VarargsWrapper(), (ids,), None),
        (tiny_llama(), (ids,), {"attention_mask": torch.ones_like(ids)}),
        (tiny_llama(), [ids], None),
    ]
    for model, args, kwargs in cases:
        captured = capture(model, args, kwargs)
        assert captured.frontend == "export"
        assert captured.dim_sizes == {"batch": 4, "seq": 16}
        assert captured.admits_batch(2)


class _Broken(nn.Module):
    def forward(self, x):
        raise TypeError("this model cannot take that input")


def test_a_capture_failure_is_named_by_torch_exports_own_error():
    """fx.symbolic_trace's complaint (here: iterating a Proxy) does not decide the
    diagnosis when torch.export's own error names another cause."""
    with pytest.raises(CaptureError) as info:
        capture(_Broken(), (torch.randn(2, 8),))
    message = str(info.value)
    assert "torch.export failed with TypeError" in message
    assert "control flow" not in message
    assert "this model cannot take that input" in message
