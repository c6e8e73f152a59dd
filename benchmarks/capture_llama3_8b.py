"""Capturing Llama-3-8B on the meta device: autopart.capture against torch.export alone.

    python benchmarks/capture_llama3_8b.py [--seq 8192]

The model (32 layers, hidden 4096, 32 heads, 8 KV heads, FFN 14336, vocabulary 128256)
is built on the meta device, so nothing is allocated. Prints one JSON line: seconds for
torch.export (non-strict, the same dynamic batch), for autopart.capture, for the
analysis passes, capture / export, and the seconds to price one plan of it on 1024
H100s (dp=128, tp=8), which the solver does for every candidate.
"""

from __future__ import annotations

import argparse

import torch
from harness import LLAMA3_8B, llama, print_json_line, timed

from autopart.capture import capture
from autopart.cost_models import Choices, predict
from autopart.degrees import Degrees
from autopart.mesh import Mesh
from autopart.passes import analyze


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    args = parser.parse_args()
    with torch.device("meta"):
        model = llama(**LLAMA3_8B, positions=args.seq)
    ids = torch.zeros(1, args.seq, dtype=torch.long, device="meta")

    dynamic_batch = ({0: torch.export.Dim.AUTO},)
    _, export_s = timed(
        lambda: torch.export.export(model, (ids,), dynamic_shapes=dynamic_batch, strict=False)
    )
    captured, capture_s = timed(lambda: capture(model, (ids,)))
    _, analyze_s = timed(lambda: analyze(captured.gm, captured.context()))
    cluster = Mesh.cluster("h100-80g", nodes=128, per_node=8)
    choices = Choices(global_batch=1024, degrees=Degrees(dp=128, tp=8))
    _, predict_s = timed(lambda: predict(captured.gm, cluster, choices))
    print_json_line(
        {
            "benchmark": "capture_llama3_8b_meta",
            "seq": args.seq,
            "nodes": len(captured.gm.graph.nodes),
            "torch_export_s": round(export_s, 2),
            "autopart_capture_s": round(capture_s, 2),
            "analysis_s": round(analyze_s, 2),
            "ratio": round(capture_s / export_s, 3),
            "target_capture_s": 15,
            "predict_plan_s": round(predict_s, 2),
            "target_predict_plan_s": 1.0,
        }
    )


if __name__ == "__main__":
    main()
