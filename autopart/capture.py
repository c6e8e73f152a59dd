"""Capture: an `nn.Module` and example inputs → one graph IR.

The main front end is `torch.export` (non-strict), which gives ATen training IR with a
FakeTensor `val` on every node and the module path of every operator. `fx.symbolic_trace`
is the second front end, for models export cannot take but fx can (outputs that are not
pytrees, data-dependent shapes); its nodes get `val` from fake-tensor propagation.
Dynamo's graphs (the torch.compile backend) enter through `from_graph_module`.

Both work on the meta device. When neither front end can capture a model, `CaptureError`
names the failing construct and source line and says what to change.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import linecache
import logging
import os
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from torch import fx, nn
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils import _pytree as pytree

from autopart.batch import BATCH, SEQ, batch_size, floating_in
from autopart.ops.meta import EXAMPLE_DIMS, SHAPE, TensorInfo
from autopart.ops.params import parameter_names
from autopart.passes.runner import PassContext

log = logging.getLogger("autopart.capture")


class CaptureError(RuntimeError):
    """A model autopart cannot turn into a graph."""


@dataclass
class Captured:
    """The captured program and what later stages need to know about it."""

    gm: fx.GraphModule
    frontend: str  # "export" | "symbolic_trace" | "dynamo"
    example_args: tuple[Any, ...]
    example_kwargs: dict[str, Any]
    # Named dynamic dims ("batch", "seq") and the exporter's symbols for them.
    dims: dict[str, sympy.Symbol] = field(default_factory=dict)
    symbols: dict[sympy.Symbol, sympy.Symbol] = field(default_factory=dict)
    # Sizes each named dim may take at run time (inclusive).
    dim_ranges: dict[str, tuple[int, float]] = field(default_factory=dict)

    @property
    def dim_sizes(self) -> dict[str, int]:
        """The size each named dim has in the example inputs."""
        sizes: dict[str, int] = {}
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        for node, arg in zip(placeholders, pytree.tree_leaves(self.example_args)):
            val = node.meta.get("val")
            if not isinstance(arg, torch.Tensor) or not isinstance(val, torch.Tensor):
                continue
            for size, example in zip(val.shape, arg.shape):
                if isinstance(size, torch.SymInt) and size.node.expr in self.symbols:
                    sizes[self.symbols[size.node.expr].name] = int(example)
        return sizes

    def input_shapes(self) -> tuple[TensorInfo | None, ...]:
        """The model's (flattened) inputs as captured: shapes in the named dims (needs
        the shape analysis)."""
        shapes = (SHAPE.get(n, None) for n in self.gm.graph.find_nodes(op="placeholder"))
        return tuple(s if isinstance(s, TensorInfo) else None for s in shapes)

    def admits_batch(self, size: int) -> bool:
        """Whether the program runs unchanged on a batch (dim 0) of `size`."""
        if BATCH not in self.dims:
            return size == batch_size(self.example_args)
        low, high = self.dim_ranges[BATCH]
        return low <= size <= high

    @property
    def parameter_names(self) -> dict[str, str]:
        """Every name a parameter is reachable by -> its canonical (first) FQN."""
        return parameter_names(self.gm)

    def context(self, **fields: Any) -> PassContext:
        """The pass context of this capture; `fields` set or override the others."""
        fields.setdefault("example_args", self.example_args)
        return PassContext(symbols=self.symbols, params=self.parameter_names, **fields)

    @property
    def fingerprint(self) -> str:
        return model_fingerprint(self.gm)


def model_fingerprint(model: nn.Module) -> str:
    """A stable hash of the parameters' names, shapes and dtypes."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    return h.hexdigest()[:16]


def capture(
    model: nn.Module,
    example_inputs: tuple[Any, ...] | Any,
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    dynamic_shapes: Any = None,
    dynamic_batch: bool = True,
    autocast: torch.dtype | None = None,
    param_dtype: torch.dtype | None = None,
) -> Captured:
    """Capture `model` as an fx graph, by torch.export, else by fx.symbolic_trace.

    `dynamic_shapes` takes torch.export's form (`torch.export.Dim("batch")` ...); the Dim
    names become the symbols of the FLOP and byte expressions. Without it, dim 0 of every
    positional input is the dynamic dim "batch" where the model allows (`dynamic_batch`),
    so one program serves every microbatch size. With `autocast` (a low dtype) the model
    is traced under torch.autocast, as a mixed-precision program must be: the graph then
    runs under the same autocast. With `param_dtype` (16-bit parameters) the model is
    traced with its floating parameters and inputs in that dtype, as FSDP2's mixed
    precision runs it: code that reads a tensor's dtype records it.
    """
    # A list of inputs is the positional arguments, as a tuple is.
    args = tuple(example_inputs) if isinstance(example_inputs, tuple | list) else (example_inputs,)
    kwargs = dict(example_kwargs or {})
    if dynamic_shapes is None and dynamic_batch:
        dynamic_shapes = _dynamic_batch(model, args, kwargs)
    device_type = _device_type(model, args)
    if param_dtype is not None:
        args, kwargs = floating_in((args, kwargs), param_dtype)
    with (
        torch.autocast(device_type, dtype=autocast, enabled=autocast is not None),
        parameters_in(model, param_dtype),
    ):
        captured = _capture_either(model, args, kwargs, dynamic_shapes)
    _bound_sequence(captured, model)
    EXAMPLE_DIMS.set(captured.gm, captured.dim_sizes)
    return captured


@contextlib.contextmanager
def parameters_in(
    model: nn.Module, dtype: torch.dtype | None, trained_only: bool = False
) -> Iterator[None]:
    """`model`'s floating parameters (those that need gradients, `trained_only`) hold
    `dtype` while it is captured and analysed (nesting: the innermost restores what the
    outer set); their values (and gradients) come back after. The graph keeps the
    parameter objects themselves, so the runtime finds the fp32 values there for the
    masters, and lowers them."""
    held = [
        (p, p.data, p.grad)
        for p in model.parameters()
        if dtype is not None
        and p.is_floating_point()
        and p.dtype != dtype
        and (p.requires_grad or not trained_only)
    ]
    for p, data, _ in held:
        p.grad = None
        p.data = data.to(dtype)
    try:
        yield
    finally:
        for p, data, grad in held:
            p.data = data
            p.grad = grad


def _bound_sequence(captured: Captured, model: nn.Module) -> None:
    """A dynamic sequence no longer than the positions the model is configured for
    (Hugging Face's `max_position_embeddings`, or GPT-2's `n_positions`): the exporter
    cannot see that a learned position table ends there, and a longer batch would fail
    inside the step, on the ranks that read the table only."""
    if SEQ not in captured.dim_ranges:
        return
    config = getattr(model, "config", None)
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if isinstance(limit, int):
        low, high = captured.dim_ranges[SEQ]
        captured.dim_ranges[SEQ] = (low, min(high, limit))


def _dynamic_batch(model: nn.Module, args: tuple, kwargs: dict) -> Any:
    """torch.export's dynamic shapes with dim 0 of every tensor input dynamic, in the
    structure of `forward`'s own parameters (so `*args`, `**kwargs` and keyword inputs
    get specs of their own shape); by position where the signature cannot bind them."""
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return tuple(_batch_spec(a) for a in args)
    return {name: _batch_spec(value) for name, value in bound.arguments.items()}


def _batch_spec(value: Any) -> Any:
    """Dim 0 of a tensor is the batch; dim 1 of an integer tensor (token ids, masks) the
    sequence. AUTO lets the exporter keep a dim static where the model needs it to be
    (a fixed-length position table), so the spec never makes a capture fail."""
    if isinstance(value, torch.Tensor):
        if not value.dim():
            return None
        if value.dim() >= 2 and not value.is_floating_point():
            return {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}
        return {0: torch.export.Dim.AUTO}
    if isinstance(value, tuple | list):
        return type(value)(_batch_spec(v) for v in value)
    if isinstance(value, dict):
        return {k: _batch_spec(v) for k, v in value.items()}
    return None


def _capture_either(model: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any) -> Captured:
    try:
        return _capture_export(model, args, kwargs, dynamic_shapes)
    except Exception as export_error:  # noqa: BLE001 - any failure falls to the next front end
        log.info("torch.export could not capture the model (%s); trying fx", export_error)
        try:
            return _capture_symbolic_trace(model, args, kwargs)
        except Exception as fx_error:  # noqa: BLE001
            raise CaptureError(explain_capture_failure(model, export_error, fx_error)) from (
                export_error
            )


def _device_type(model: nn.Module, args: tuple) -> str:
    tensors = [*model.parameters(), *pytree.tree_leaves(args)]
    device = next((t.device.type for t in tensors if isinstance(t, torch.Tensor)), "cpu")
    return "cpu" if device == "meta" else device


def _capture_export(model: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any) -> Captured:
    ep = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
    gm = ep.module(check_guards=False)  # input checks as a pre-hook, not a graph node
    dims, symbols = _named_dims(gm, args, kwargs, dynamic_shapes)
    ranges = {
        symbols[s].name: (int(r.lower), float(r.upper))
        for s, r in ep.range_constraints.items()
        if s in symbols
    }
    return Captured(gm, "export", args, kwargs, dims, symbols, ranges)


def _capture_symbolic_trace(model: nn.Module, args: tuple, kwargs: dict) -> Captured:
    if kwargs:
        raise CaptureError("fx.symbolic_trace takes positional example inputs only")
    gm = fx.symbolic_trace(model)
    propagate_fake_values(gm, args)
    return Captured(gm, "symbolic_trace", args, kwargs)


def from_graph_module(gm: fx.GraphModule, example_inputs: tuple[Any, ...]) -> Captured:
    """Wrap a graph someone else traced (dynamo's), giving every node a fake `val`."""
    if not all("val" in n.meta for n in gm.graph.nodes if n.op == "call_function"):
        propagate_fake_values(gm, example_inputs)
    return Captured(gm, "dynamo", tuple(example_inputs), {})


def propagate_fake_values(gm: fx.GraphModule, args: tuple) -> None:
    """Give every node a FakeTensor `val`, as torch.export does."""
    mode = torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True)
    fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fake_args)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, arg in zip(placeholders, fake_args):
        node.meta.setdefault("val", arg)  # non-tensor inputs (options objects) as they are


def _named_dims(
    gm: fx.GraphModule, args: tuple, kwargs: dict, dynamic_shapes: Any
) -> tuple[dict[str, sympy.Symbol], dict[sympy.Symbol, sympy.Symbol]]:
    """Map the exporter's size symbols to symbols named after the user's Dims: a tuple
    aligned with the positional inputs, or autopart's own dynamic batch (a dict by
    `forward`'s parameters), whose spec of each input leaf is `_batch_spec`'s."""
    if dynamic_shapes is None:
        return {}, {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if isinstance(dynamic_shapes, dict):
        flat_args = pytree.tree_leaves((args, kwargs))
        specs = [_batch_spec(a) for a in flat_args]
    else:
        specs = (
            list(dynamic_shapes) if isinstance(dynamic_shapes, tuple | list) else [dynamic_shapes]
        )
        flat_args = pytree.tree_leaves(args)
    dims: dict[str, sympy.Symbol] = {}
    symbols: dict[sympy.Symbol, sympy.Symbol] = {}
    for node, arg, spec in zip(placeholders, flat_args, specs):
        if not isinstance(arg, torch.Tensor) or not spec:
            continue
        val = node.meta.get("val")
        for dim, d in spec.items():
            name = getattr(d, "__name__", None) or {0: BATCH, 1: SEQ}.get(dim, f"dim{dim}")
            size = val.shape[dim]
            if not isinstance(size, torch.SymInt) or not isinstance(size.node.expr, sympy.Symbol):
                continue
            if size.node.expr in symbols:
                continue
            if name in dims and name != BATCH and getattr(d, "__name__", None) is None:
                # Another input's dim 1 of another length (a decoder's sequence beside an
                # encoder's): a dim of its own.
                name = f"{name}{sum(n.startswith(name) for n in dims)}"
            named = dims.setdefault(name, sympy.Symbol(name, positive=True, integer=True))
            symbols[size.node.expr] = named
    return dims, symbols


# ---------------------------------------------------------------------------------------
# Explaining a failure


def explain_capture_failure(model: nn.Module, export_error: Exception, fx_error: Exception) -> str:
    construct, advice = _classify(export_error, fx_error)
    where = _user_frame(export_error) or _user_frame(fx_error)
    location = ""
    if where is not None:
        filename, lineno, code = where
        location = f"\n  at {filename}:{lineno}: {code}"
    return (
        f"autopart cannot capture {type(model).__name__}: {construct}.{location}\n"
        f"  torch.export said: {_first_line(export_error)}\n"
        f"  fx.symbolic_trace said: {_first_line(fx_error)}\n"
        f"  What to change: {advice}"
    )


def _classify(export_error: Exception, fx_error: Exception) -> tuple[str, str]:
    """What went wrong and what to change: torch.export's own error decides where it
    names a known cause; fx.symbolic_trace's (which fails on much that export handles,
    `*args` among them) only where export's names none."""
    for text in (f"{type(export_error).__name__}: {export_error}", str(fx_error)):
        found = _known_cause(text)
        if found is not None:
            return found
    return (
        f"torch.export failed with {type(export_error).__name__}",
        "see what torch.export said below; keep forward() to torch operations on tensors",
    )


def _known_cause(text: str) -> tuple[str, str] | None:
    if "data-dependent" in text or "GuardOnDataDependent" in text or "control flow" in text:
        return (
            "Python control flow depends on a tensor's values",
            "make the branch depend on shapes or configuration instead of tensor values, "
            "or express it with torch.cond / torch.where",
        )
    if "not a known type" in text or "pytree" in text:
        return (
            "the model returns or takes an object that is not a tensor, tuple, list or dict",
            "return plain tensors (for Hugging Face models pass use_cache=False in the config)"
            " or register the type with torch.utils._pytree.register_pytree_node",
        )
    if "numpy" in text.lower() or ".item()" in text:
        return (
            "the model leaves torch for Python or NumPy values",
            "keep the computation in torch operations on tensors",
        )
    return None


def _user_frame(error: BaseException) -> tuple[str, int, str] | None:
    """The deepest traceback frame outside torch and autopart: the user's line."""
    torch_dir = os.path.dirname(torch.__file__)
    own_dir = os.path.dirname(__file__)
    best = None
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        for frame in traceback.extract_tb(e.__traceback__):
            path = frame.filename
            if path.startswith((torch_dir, own_dir)) or "<" in path or "site-packages/_" in path:
                continue
            code = (frame.line or linecache.getline(path, frame.lineno or 0)).strip()
            best = (path, frame.lineno or 0, code)
        e = e.__cause__ or e.__context__
    return best


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
