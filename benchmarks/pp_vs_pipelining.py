"""autopart pipeline parallelism against a hand split with torch.distributed.pipelining.

    python benchmarks/pp_vs_pipelining.py [--world 2] [--schedule 1f1b] [--steps 30]

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

import torch
import torch.distributed as dist
import torch.nn.functional as F
from timing import compare, report
from torch import nn
from torch.distributed.pipelining import PipelineStage

import autopart
from autopart.runtime.pipeline import SCHEDULE_CLASSES
from autopart.testing import run_world

VOCAB = 2048


def build_model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return LlamaForCausalLM(config)


def loss_fn(output, target):
    return F.cross_entropy(output.logits.flatten(0, 1), target.flatten())


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
    """This rank's hand-written stage at autopart's cuts, and its schedule."""
    world, rank = dist.get_world_size(), dist.get_rank()
    bounds = [0] + [int(cut.rsplit(".", 1)[1]) for cut in cuts] + [len(model.model.layers)]
    module = HandStage(model, bounds[rank], bounds[rank + 1])

    def microbatch_loss(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten()) / microbatches

    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    runner = SCHEDULE_CLASSES[schedule](
        stage, microbatches, loss_fn=microbatch_loss, scale_grads=False
    )
    return module, runner


def _bench(schedule: str, steps: int, rounds: int, batch: int, seq: int, micro: int) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    target = torch.randint(0, VOCAB, (batch, seq), generator=g)

    pm = autopart.parallelize(
        build_model(),
        autopart.Mesh.local(),
        (ids,),
        loss_fn=loss_fn,
        optimizer=lambda p: torch.optim.SGD(p, lr=1e-3),
        pp=world,
        schedule=schedule,
        microbatches=micro,
    )
    module, runner = native_pipeline(build_model(), pm.plan.stage_cuts, schedule, micro)
    native_opt = torch.optim.SGD(module.parameters(), lr=1e-3)

    def native_step() -> float:
        native_opt.zero_grad()
        losses: list[torch.Tensor] = []
        if rank == 0:
            runner.step(ids)
        else:
            runner.step(target=target if rank == world - 1 else None, losses=losses)
        native_opt.step()
        return float(sum(loss.detach() for loss in losses))

    def autopart_step() -> float:
        return pm.train_step(ids, target).item()

    result = compare(autopart_step, native_step, steps, rounds)
    pm.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args()
    per_rank = run_world(
        _bench,
        args.world,
        args.schedule,
        args.steps,
        args.rounds,
        args.batch,
        args.seq,
        args.microbatches,
    )
    # The last stage's rank holds both losses.
    print(
        report(
            "pp_vs_pipelining",
            per_rank,
            1.05,
            loss_rank=-1,
            world=args.world,
            schedule=args.schedule,
            batch=args.batch,
            seq=args.seq,
            microbatches=args.microbatches,
        )
    )


if __name__ == "__main__":
    main()
