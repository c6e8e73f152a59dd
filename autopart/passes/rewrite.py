"""The rewrite stage: from the captured graph and a plan to this rank's program.

`REWRITES` declares the rewrite passes in the order they run, each with the plans it
applies to and what it runs on: the whole graph, or (after the pipeline split keeps
this rank's stages) each stage. `run_passes` applies them, so each is timed and can be
disabled by name (`PassContext.disabled`).

    drop capture assertions   local shards and autocast change sizes, dtypes
    causal attention          explicit causal masks back to `is_causal=True`
    tensor parallelism        shard parameters, insert tp collectives (tp > 1)
    context parallelism       shard the sequence, ring attention (cp > 1)
    expert parallelism        split each routed layer's experts, all_to_all (ep > 1)
    batch norm                training-mode batch norms take the whole batch's
                              statistics over the replicas, or per part, the first
                              replica's running ones (dp × ep > 1)
    batch products            a batch × batch product's operands gathered over the
                              replicas; the loss gets its rows or the whole (dp × ep > 1)
    batch statistics          statistics combined over the batch (a load-balancing
                              loss) taken as every replica's mean (dp × ep > 1)
    ── pipeline split ──       cut the graph into stages, keep this rank's (pp > 1)
    materialize               real memory for this rank's pieces of a meta model
    retarget devices          device arguments and tensors on this rank's device
    widen weight reads        master weights on the host: non-contractions read the
                              device's 16-bit weights widened (master_weights.py)
    recompute                 the plan's blocks (or their attention cores) run under
                              activation checkpointing
    ZeRO-3                    shard each stage's parameters over dp; gather on use
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import fx

from autopart.ops.meta import CP_SUMMED, EP_SHARDED, TP_LAYOUT, VOCAB_PARALLEL_LOSS
from autopart.ops.program import RankProgram
from autopart.passes.batch_norm import batch_norm_pass, splits_norms
from autopart.passes.batch_products import batch_products_pass, splits_products
from autopart.passes.batch_statistics import batch_statistics_pass, splits_statistics
from autopart.passes.causal_attention import causal_attention_pass
from autopart.passes.context_parallel import context_parallel_pass
from autopart.passes.expert_parallel import expert_parallel_pass
from autopart.passes.master_weights import widen_weight_reads_pass
from autopart.passes.materialize import materialize_pass
from autopart.passes.pipeline_split import split_stages
from autopart.passes.recompute import recompute_pass
from autopart.passes.retarget import drop_capture_assertions_pass, retarget_devices_pass
from autopart.passes.runner import Pass, PassContext, run_passes
from autopart.passes.tensor_parallel import tensor_parallel_pass
from autopart.passes.zero import zero3_pass
from autopart.plan import Plan
from autopart.policy import MasterWeights


def _always(plan: Plan) -> bool:
    return True


@dataclass(frozen=True, slots=True)
class Rewrite:
    """One rewrite pass: when the plan calls for it, and whether it runs on each of this
    rank's pipeline stages (after the split) or on the whole graph (before it)."""

    run: Pass
    applies: Callable[[Plan], bool] = _always
    per_stage: bool = False


REWRITES: tuple[Rewrite, ...] = (
    Rewrite(drop_capture_assertions_pass),
    Rewrite(causal_attention_pass),
    Rewrite(tensor_parallel_pass, lambda plan: plan.tp > 1),
    Rewrite(context_parallel_pass, lambda plan: plan.cp > 1),
    Rewrite(expert_parallel_pass, lambda plan: plan.ep > 1),
    Rewrite(batch_norm_pass, splits_norms),
    Rewrite(batch_products_pass, splits_products),
    Rewrite(batch_statistics_pass, splits_statistics),
    Rewrite(materialize_pass, per_stage=True),
    Rewrite(retarget_devices_pass, per_stage=True),
    Rewrite(
        widen_weight_reads_pass,
        lambda plan: plan.master_weights == MasterWeights.HOST,
        per_stage=True,
    ),
    Rewrite(
        recompute_pass,
        lambda plan: bool(plan.recompute or plan.recompute_attention),
        per_stage=True,
    ),
    Rewrite(zero3_pass, lambda plan: plan.zero == 3, per_stage=True),
)


def rank_program(gm: fx.GraphModule, ctx: PassContext) -> RankProgram:
    """This rank's program of the captured `gm`, for the plan and mesh place in
    `ctx.target`."""
    plan = ctx.rank.plan

    def passes(per_stage: bool) -> list[Pass]:
        return [r.run for r in REWRITES if r.per_stage == per_stage and r.applies(plan)]

    gm = run_passes(gm, ctx, passes(per_stage=False))
    if plan.pp > 1:
        stages, stage_ids = split_stages(gm, ctx)
    else:
        stages, stage_ids = [gm], [0]
    stages = [run_passes(stage, ctx, passes(per_stage=True)) for stage in stages]
    loss = VOCAB_PARALLEL_LOSS.get(gm) if VOCAB_PARALLEL_LOSS.has(gm) else None
    summed, experts = CP_SUMMED.get(gm, frozenset()), EP_SHARDED.get(gm, frozenset())
    return RankProgram(stages, stage_ids, TP_LAYOUT.get(gm, {}), loss, summed, experts)
