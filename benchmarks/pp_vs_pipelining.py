"""autopart pipeline parallelism against a hand split with torch.distributed.pipelining.

    python benchmarks/pp_vs_pipelining.py [--world 2] [--schedule 1f1b] [--steps 30]

`--schedule` is gpipe, 1f1b or interleaved-1f1b (two chunks per rank on both sides).

Both train the same Llama-style model on the same global batch, in the same number of
microbatches and the same schedule, over Gloo on local CPU processes (one pipeline stage
per process). The hand split cuts the model where autopart's plan does, writes each stage
as an nn.Module over the Hugging Face layers (as LlamaModel.forward runs them) and runs it
with PipelineStage and the matching schedule class. Steps alternate between the two in
rounds, so drift in machine load hits both alike. Prints one JSON line: each median step
time and autopart / native.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import Step, comparison_options, llama, run_comparison, sgd, time_against_native
from torch import nn
from torch.distributed.pipelining import PipelineStage
from transformers import LlamaForCausalLM

import autopart
from autopart.runtime.pipeline import SCHEDULE_CLASSES


def build_model() -> LlamaForCausalLM:
    return llama(
        hidden=256, intermediate=768, layers=8, heads=4, kv_heads=4, vocab=2048, positions=128
    )


class HandStage(nn.Module):
    """Layers [start, stop) of a Llama model, run as LlamaModel.forward runs them; the
    first stage also embeds, the last also normalizes and projects to the vocabulary."""

    def __init__(self, model, start: int, stop: int) -> None:
        super().__init__()
        self.config = model.config
        self.first, self.last = start == 0, stop == len(model.model.layers)
        self.embed_tokens = model.model.embed_tokens if self.first else None
        self.layers = nn.ModuleList(model.model.layers[start:stop])
        self.rotary_emb = model.model.rotary_emb
        self.norm = model.model.norm if self.last else None
        self.lm_head = model.lm_head if self.last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        hidden = self.embed_tokens(x) if self.first else x
        positions = torch.arange(hidden.shape[1]).unsqueeze(0)
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=None,
            past_key_values=None,
            position_ids=positions,
        )
        rotary = self.rotary_emb(hidden, position_ids=positions)
        for layer in self.layers:
            hidden = layer(
                hidden, attention_mask=mask, position_embeddings=rotary, position_ids=positions
            )
        return self.lm_head(self.norm(hidden)) if self.last else hidden


def native_pipeline(model, cuts: tuple[str, ...], schedule: str, microbatches: int):
    """This rank's hand-written stages at autopart's cuts (chunk k on rank k mod world:
    one chunk, or two under the interleaved schedule), and its schedule."""
    world, rank = dist.get_world_size(), dist.get_rank()
    bounds = [0] + [int(cut.rsplit(".", 1)[1]) for cut in cuts] + [len(model.model.layers)]
    chunks = len(bounds) - 1
    mine = list(range(rank, chunks, world))
    modules = [HandStage(model, bounds[k], bounds[k + 1]) for k in mine]

    def microbatch_loss(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten()) / microbatches

    stages = [
        PipelineStage(module, k, chunks, torch.device("cpu")) for k, module in zip(mine, modules)
    ]
    runner = SCHEDULE_CLASSES[schedule](
        stages if len(stages) > 1 else stages[0],
        microbatches,
        loss_fn=microbatch_loss,
        scale_grads=False,
    )
    return nn.ModuleList(modules), runner


def pipelining_baseline(
    schedule: str,
    microbatches: int,
    pm: autopart.ParallelModule,
    ids: torch.Tensor,
    target: torch.Tensor,
) -> Step:
    """A step of this rank's hand-written stage, cut where autopart's plan cuts; only the
    last stage sees the losses, the other ranks return 0."""
    world, rank = dist.get_world_size(), dist.get_rank()
    module, runner = native_pipeline(build_model(), pm.plan.stage_cuts, schedule, microbatches)
    native_opt = sgd(module.parameters())

    def native_step() -> float:
        native_opt.zero_grad()
        losses: list[torch.Tensor] = []
        if rank == 0:
            runner.step(ids)
        else:
            runner.step(target=target if rank == world - 1 else None, losses=losses)
        native_opt.step()
        return float(sum(loss.detach() for loss in losses))

    return native_step


def _bench(args: argparse.Namespace) -> dict:
    baseline = partial(pipelining_baseline, args.schedule, args.microbatches)
    pins = {"pp": args.world, "schedule": args.schedule, "microbatches": args.microbatches}
    if args.schedule == "interleaved-1f1b":
        pins["virtual_stages"] = 2
    return time_against_native(args, build_model, sgd, baseline, **pins)


def main() -> None:
    parser = comparison_options(__doc__, steps=30, rounds=3, batch=16, seq=64)
    parser.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved-1f1b"], default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args()
    run_comparison(
        _bench,
        args,
        "pp_vs_pipelining",
        target_ratio=1.05,
        settings=("world", "schedule", "batch", "seq", "microbatches"),
        loss_rank=-1,  # the last stage's rank holds both losses
    )


if __name__ == "__main__":
    main()
