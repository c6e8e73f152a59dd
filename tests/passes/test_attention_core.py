"""Attention cores: found by structure, and what recomputing one alone frees."""

from __future__ import annotations

import sympy

from autopart.capture import capture
from autopart.ops.aten import op_name
from autopart.ops.meta import ATTENTION_CORE, CORE_FREES_BYTES
from autopart.passes import analyze
from tests.models import LM_FACTORIES, token_batch


def _analyzed(name: str):
    captured = capture(LM_FACTORIES[name](), (token_batch(4)[0],))
    analyze(captured.gm, captured.context())
    return captured.gm


def _cores(gm) -> dict[int, list]:
    cores: dict[int, list] = {}
    for node in gm.graph.nodes:
        if ATTENTION_CORE.has(node):
            cores.setdefault(ATTENTION_CORE.get(node), []).append(node)
    return cores


def _frees(core) -> sympy.Expr:
    return sympy.Add(*(CORE_FREES_BYTES.get(n) for n in core))


def test_written_out_attention_is_scores_to_weighted_values():
    gm = _analyzed("gpt2-eager")
    cores = _cores(gm)
    assert len(cores) == 2  # one per layer
    for core in cores.values():
        ops = [op_name(n, gm) for n in core if not op_name(n, gm).startswith("_assert")]
        assert ops == ["matmul", "mul", "add", "softmax", "to", "dropout", "matmul"]
    # What it frees grows with the sequence squared: the probabilities (4 heads, fp32),
    # less the causal mask it keeps as an input (one fp32 value per query and key).
    batch, seq = sympy.symbols("batch seq", integer=True, positive=True)
    frees = _frees(next(iter(cores.values())))
    assert frees.subs({s: {"batch": batch, "seq": seq}[s.name] for s in frees.free_symbols}) == (
        12 * batch * seq**2
    )


def test_a_fused_attention_is_a_core_by_itself_and_frees_little():
    gm = _analyzed("llama")
    cores = _cores(gm)
    assert len(cores) == 2
    for core in cores.values():
        assert [op_name(n, gm) for n in core] == ["scaled_dot_product_attention"]
        # The kernel saves no scores: recomputing it frees its output's copy and the
        # log-sum-exp, nothing that grows with the sequence squared.
        frees = _frees(core)
        (seq,) = (s for s in frees.free_symbols if s.name == "seq")
        assert frees != 0 and sympy.degree(frees, seq) == 1
