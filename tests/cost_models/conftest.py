"""Large models captured on the meta device once per test session."""

from __future__ import annotations

import pytest
import torch

from autopart.passes import analyze
from autopart.stack_expansion import capture_repeated_once
from tests.models import llama3_8b_on_meta

# Megatron-LM's FLOPs check: a GPT with h=1024, l=8, s=1024, V=50257 (tied embeddings).
GPT = {"hidden": 1024, "layers": 8, "seq": 1024, "vocab": 50257, "batch": 2}


def _analyzed_gm(model, ids):
    # The repeated stack traced once and copied: the whole capture's graph
    # (tests/test_stack_expansion.py), in a fraction of its time.
    captured = capture_repeated_once(model, (ids,))
    analyze(captured.gm, captured.context())
    return captured.gm


@pytest.fixture(scope="session")
def gpt_graph():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_embd=GPT["hidden"],
        n_layer=GPT["layers"],
        n_head=16,
        vocab_size=GPT["vocab"],
        n_positions=GPT["seq"],
        use_cache=False,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    ids = torch.zeros(GPT["batch"], GPT["seq"], dtype=torch.long, device="meta")
    return _analyzed_gm(model, ids)


@pytest.fixture(scope="session")
def llama3_8b_graph():
    """Llama-3-8B's shape (hidden 4096, 32 layers, 32 heads, 8 KV heads, FFN 14336,
    vocab 128256) at sequence 2048, batch dynamic."""
    model = llama3_8b_on_meta()
    return _analyzed_gm(model, torch.zeros(8, 2048, dtype=torch.long, device="meta"))
