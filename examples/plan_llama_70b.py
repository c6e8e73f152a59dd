"""Plan Llama-3-70B for 1024 H100s without allocating it, and write the HTML report.

    python examples/plan_llama_70b.py [--out DIR]

The model is built on the meta device from its published shape (hidden 8192, 80 layers,
64 heads with 8 key/value heads, FFN 28672, vocabulary 128256), so nothing is allocated
and the machine planning it needs no GPU. autopart captures it, prices every plan the
pins leave open on 128 nodes of 8 H100s (sequences of 8192 tokens, a global batch of
1024, bf16 mixed precision), prints the chosen plan and why, saves it, and writes the
report page: the pipeline timeline, memory per rank against the device, layers per
stage, collectives, and the alternatives the solver weighed. They go to `--out`, by
default a new temporary directory, whose path it prints.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import autopart
from autopart.report import write_html


def llama3_70b() -> LlamaForCausalLM:
    config = LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        use_cache=False,
    )
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="the report's directory (default: a temporary one)")
    parser.add_argument("--nodes", type=int, default=128, help="nodes of 8 H100s")
    parser.add_argument("--batch", type=int, default=1024, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=8192)
    args = parser.parse_args(argv)

    start = time.perf_counter()
    model = llama3_70b()
    ids = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
    mesh = autopart.Mesh.cluster("h100-80g", nodes=args.nodes, per_node=8)
    plan = autopart.plan(model, mesh, (ids,), precision="bf16-mixed")
    print(plan, end="\n\n")
    print(plan.explain(), end="\n\n")
    out = Path(args.out or tempfile.mkdtemp(prefix="llama70b-report-"))
    out.mkdir(parents=True, exist_ok=True)
    plan.save(out / "plan.json")
    page = write_html(plan, out)
    print(f"planned in {time.perf_counter() - start:.1f} s; wrote {out / 'plan.json'} and {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
