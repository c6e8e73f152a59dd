r"""The bytes autograd saves for backward, attributed to the operator that saves them.

Measured, not guessed: the graph runs once on fake tensors (no memory, no compute) with
`saved_tensors_hooks` recording every tensor autograd packs. A storage is counted once,
at the first operator that saves it, at the size of its whole base tensor (a saved view
keeps its base alive). Parameters are not activations and are left out; graph inputs
(the microbatch) are counted. Summed over the graph this is the activation memory of one
microbatch without recomputation.

Attention is measured as the fused kernel that PyTorch picks for training on CPU and GPU
alike (flash / memory-efficient), which saves q, k, v, the output and the log-sum-exp
instead of the score matrix. On the meta device the dispatcher would take the unfused
math path, whose O(L·S) saved scores no real device keeps. An attention whose mask needs
a gradient (a learned position bias, as in T5) is measured on the math path: the fused
kernels cannot differentiate a mask, and the dispatcher runs the math path for it.

Selective recomputation. For each attention core (`attention_core`), with C the storages
its nodes save, I those of its inputs (what a recomputed core keeps instead) and N those
the other nodes save, recomputing the core alone frees |C \ N| − |I \ N| bytes,
recorded on the core's first node.
"""

from __future__ import annotations

from typing import Any

import sympy
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.autograd.graph import saved_tensors_hooks
from torch.utils import _pytree as pytree

from autopart.ops.meta import ATTENTION_CORE, CORE_FREES_BYTES, SAVED_BYTES
from autopart.passes.blocks import block_counterparts
from autopart.passes.runner import PassContext


def saved_for_backward_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    tracker = _SavedTensorTracker(gm)
    with torch.enable_grad():
        tracker.run(*tracker.fake_inputs())
    for node in gm.graph.nodes:
        # Converted only now: the fake run may learn equalities between sizes late.
        sizes = tracker.saved.get(node, ())
        SAVED_BYTES.set(node, sympy.Add(*(ctx.expr(s) for s in sizes)))
        if ATTENTION_CORE.has(node):
            CORE_FREES_BYTES.set(node, sympy.Integer(0))
    for core, first in tracker.core_first.items():
        saved, inputs = tracker.core_saved[core], tracker.core_inputs[core]
        frees = _total(saved, tracker.outside, ctx) - _total(inputs, tracker.outside, ctx)
        CORE_FREES_BYTES.set(first, sympy.Max(0, frees))
    for node, first in tracker.counterpart.items():
        if ATTENTION_CORE.has(node):
            CORE_FREES_BYTES.set(node, CORE_FREES_BYTES.get(first))
    return gm


def _total(storages: dict[int, Any], outside: set[int], ctx: PassContext) -> sympy.Expr:
    return sympy.Add(*(ctx.expr(size) for s, size in storages.items() if s not in outside))


class _SavedTensorTracker(fx.Interpreter):
    """Runs the graph on fake tensors. A later copy of a repeated block is not run
    again: its nodes take the first copy's values and saved bytes (what the cost
    models price for every copy), so an 80-layer model costs one layer's dispatch.
    It also gathers, by storage, what selective recomputation frees (module docstring)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.mode = _fake_mode(gm)
        self.saved: dict[fx.Node, list[int | torch.SymInt]] = {}
        self._seen_storages: set[int] = set()
        self._keep_alive: list[torch.Tensor] = []
        self.counterpart = block_counterparts(gm)
        self._first_values: dict[fx.Node, Any] = dict.fromkeys(self.counterpart.values())
        # Per attention core: its first node, the storages its nodes save and those of
        # its inputs (storage -> bytes); the storages other nodes save.
        self.core_first: dict[int, fx.Node] = {}
        self.core_saved: dict[int, dict[int, Any]] = {}
        self.core_inputs: dict[int, dict[int, Any]] = {}
        self.outside: set[int] = set()

    def fake_inputs(self) -> list[Any]:
        return [n.meta.get("val") for n in self.graph.nodes if n.op == "placeholder"]

    def run_node(self, node: fx.Node) -> Any:
        first = self.counterpart.get(node)
        if first is not None:
            self.saved[node] = self.saved[first]
            return self._first_values[first]
        if node.op == "get_attr" and node.users and all(u in self.counterpart for u in node.users):
            return None  # a later copy's parameter: only copies that are not run read it
        packed: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            packed.append(t)
            return t

        with self.mode, saved_tensors_hooks(pack, lambda t: t):
            result = super().run_node(node)
        self.saved[node] = self._new_bytes(packed)
        self._record_core(node, packed)
        if node in self._first_values:
            self._first_values[node] = result
        return result

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target is torch.ops.aten.scaled_dot_product_attention.default:
            return _fused_attention(*args, **kwargs)
        return super().call_function(target, args, kwargs)

    def get_attr(self, target: fx.node.Target, args: Any, kwargs: Any) -> Any:
        value = super().get_attr(target, args, kwargs)
        if not isinstance(value, torch.Tensor):
            return value
        # Parameters keep static sizes: a symbolic size here would be a new, unnamed dim.
        fake = self.mode.from_tensor(value, static_shapes=True)
        return fake.detach().requires_grad_(value.requires_grad)

    def _record_core(self, node: fx.Node, packed: list[torch.Tensor]) -> None:
        core = _core_of(node)
        saved = {_storage(t): _base_bytes(t) for t in packed if not _is_parameter(t)}
        if core is None:
            self.outside.update(saved)
            return
        self.core_first.setdefault(core, node)
        self.core_saved.setdefault(core, {}).update(saved)
        inputs = self.core_inputs.setdefault(core, {})
        for arg in node.all_input_nodes:
            if _core_of(arg) == core:
                continue
            for t in pytree.tree_leaves(self.env.get(arg)):
                if isinstance(t, torch.Tensor) and not _is_parameter(t):
                    inputs[_storage(t)] = _base_bytes(t)
                    self._keep_alive.append(t)  # its storage's id stays its own
        self._keep_alive.extend(packed)

    def _new_bytes(self, packed: list[torch.Tensor]) -> list[int | torch.SymInt]:
        sizes: list[int | torch.SymInt] = []
        for t in packed:
            if _is_parameter(t):
                continue
            storage = _storage(t)
            if storage in self._seen_storages:
                continue
            self._seen_storages.add(storage)
            self._keep_alive.append(t)
            sizes.append(_base_bytes(t))
        return sizes


def _core_of(node: fx.Node) -> int | None:
    return ATTENTION_CORE.get(node) if ATTENTION_CORE.has(node) else None


def _base(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter, or a view of one (not an activation)."""
    base = _base(t)
    return base.requires_grad and base.grad_fn is None


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _base_bytes(t: torch.Tensor) -> int | torch.SymInt:
    """What a saved tensor keeps alive: its whole base."""
    base = _base(t)
    return base.numel() * base.element_size()


def _fake_mode(gm: fx.GraphModule) -> FakeTensorMode:
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, FakeTensor):
            return val.fake_mode
    return FakeTensorMode(allow_non_fake_inputs=True)


def _fused_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    if key.shape[-3] != query.shape[-3]:  # grouped-query attention: expand the kv heads
        repeats = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(repeats, dim=-3)
        value = value.repeat_interleave(repeats, dim=-3)
    if attn_mask is not None and attn_mask.requires_grad:
        out = torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale
        )
    else:
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
        )
    return out[0]
