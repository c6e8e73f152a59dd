"""Statistics over the batch, combined nonlinearly, under a split of the batch over
replicas (dp × ep, the batch group): the rewrite that makes a mixture-of-experts
load-balancing loss (token fractions times mean router probabilities) one device's.

After each reduction over the batch that `batch_mixing.replica_statistics` finds, the
statistic is replaced by its mean over the replicas (`ops.batch_statistics.replica_mean`,
one all-reduce of its few numbers): a mean becomes the whole batch's, and a sum, which
the model divides by its part's count, becomes the whole batch's fraction. Every
replica then computes the same loss term, as one device does on the whole batch.
"""

from __future__ import annotations

from torch import fx

from autopart.degrees import BATCH_AXES
from autopart.ops.batch_statistics import replica_mean
from autopart.ops.meta import COLLECTIVE, SHAPE, CollectiveInfo, inherit, tensor_info
from autopart.passes.batch_mixing import replica_statistics
from autopart.passes.runner import PassContext
from autopart.plan import Plan


def splits_statistics(plan: Plan) -> bool:
    """Whether the plan splits the batch over replicas and takes statistics whole."""
    return plan.degrees.batch_split > 1 and not plan.per_part_statistics


def batch_statistics_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    found = replica_statistics(gm)
    if found is None:
        return gm
    groups = ctx.rank.groups
    group = groups.batch_group().group_name
    axes = " × ".join(str(a) for a in BATCH_AXES if groups.size(a) > 1)
    for root in found.roots:
        users = list(root.users)
        with gm.graph.inserting_after(root):
            mean = gm.graph.call_function(replica_mean, (root, group))
        inherit(mean, root, SHAPE.get(root))
        nbytes = tensor_info(root).nbytes
        COLLECTIVE.set(mean, CollectiveInfo("all_reduce", axes, group, nbytes))
        for user in users:
            user.replace_input_with(root, mean)
    gm.graph.lint()
    gm.recompile()
    return gm
