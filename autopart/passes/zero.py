"""ZeRO-3 as graph rewrites: parameters sharded over dp (× ep), gathered where they are read.

    zero3_shard_pass     buckets of parameters become flat shards, one per rank, held by
                         the stage's `zero3` module (ops/zero3.py); every parameter
                         read becomes a view of its bucket, all-gathered before use
    zero3_prefetch_pass  each all-gather is issued as the previous bucket's is taken, so
                         it travels while that bucket computes; each wait stays just
                         before the first use (about two buckets gathered at a time;
                         the buckets one node reads at once are issued together)

Buckets follow first use in forward: one per repeated block (a transformer layer),
the parameters between blocks in runs, split at ZERO3_BUCKET_BYTES (policy.py), one
dtype, device, requires_grad and expert or not each; parameters the graph never reads go last, in
buckets of their own. A bucket read again after ZERO3_REGATHER_AFTER others have been
gathered is gathered again (a tied embedding read by the head), rather than staying
whole in between.

A pipeline stage's parameters that other stages read too (tied weights) stay whole:
the pipeline keeps their replicas in step through the owner (runtime/shared_params.py),
and the runtime shards their optimizer state and gradients as ZeRO-2 does.

A recomputed region (passes/recompute.py runs first) reads its parameters as inputs,
so their views become its inputs too; its recomputation in backward takes them all
at once, and the stage's shards gather each region's buckets together there
(`ShardedParameters.gathered_with`, ops/zero3.py).

Under expert parallelism the batch is split over dp × ep: the experts' weights (split
over ep already) go in buckets of their own, sharded over their dp replicas, and the
other weights' over dp × ep, as ZeRO-1/2 shard their state. With dp = 1 an expert has
one replica, and its weights stay whole (stepped as tied weights are).
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field

import torch.distributed as dist
from torch import fx, nn

from autopart.degrees import Axis
from autopart.ops.groups import MeshGroups
from autopart.ops.meta import (
    BLOCK,
    COLLECTIVE,
    EP_SHARDED,
    PARAMS,
    SHAPE,
    CollectiveInfo,
    inherit,
)
from autopart.ops.params import parameter_attributes
from autopart.ops.stage_info import PIPELINE_KEY, pipeline_info
from autopart.ops.zero3 import (
    ZERO3,
    ShardedParameters,
    ShardGroup,
    all_gather_start,
    all_gather_wait,
)
from autopart.passes.recompute import Recomputed
from autopart.passes.runner import PassContext, run_passes
from autopart.policy import ZERO3_BUCKET_BYTES, ZERO3_REGATHER_AFTER


def zero3_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    return run_passes(gm, ctx, (zero3_shard_pass, zero3_prefetch_pass))


def zero3_shard_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    groups = ctx.rank.groups
    if groups.batch_size == 1:
        return gm  # nothing to shard over one rank (runtime/data_parallel.py's LocalState)
    if hasattr(gm, ZERO3):
        raise ValueError(f"the stage already has an attribute {ZERO3!r}")
    experts = _experts(gm)
    # With one replica of each expert, its weights stay whole: the runtime steps them as
    # it steps tied weights (ZeRO-2, over their dp replicas).
    reads = _parameter_reads(gm, experts if groups.size(Axis.DP) == 1 else set())
    buckets = _buckets(gm, reads, experts)
    names = _canonical_names(gm)
    batch = groups.batch_group()
    rest = ShardGroup(batch.group_name, dist.get_rank(batch), batch.size(), _axes(groups))
    replicas = ShardGroup(
        groups.group_name(Axis.DP),
        groups.rank(Axis.DP),
        groups.size(Axis.DP),
        Axis.DP.value,
        groups.batch_size,
    )
    where = {id(p): (b, i) for b, bucket in enumerate(buckets) for i, p in enumerate(bucket)}
    module = ShardedParameters(
        [[names[id(p)] for p in bucket] for bucket in buckets],
        buckets,
        [replicas if id(bucket[0]) in experts else rest for bucket in buckets],
        _gathered_with(gm, reads, where, len(buckets)),
    )
    _remove_parameters(gm, {id(p) for bucket in buckets for p in bucket})
    gm.add_submodule(ZERO3, module)
    module.install(gm)
    _Reads(gm, module).rewrite(reads, where)
    gm.graph.lint()
    gm.recompile()
    return gm


def zero3_prefetch_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    waits = sorted(
        gm.graph.find_nodes(op="call_function", target=all_gather_wait), key=position.__getitem__
    )

    def first_reader(wait: fx.Node) -> int:
        return min(position[user] for view in wait.users for user in view.users)

    # The buckets one node reads (a recomputed region reads its block's) are waited for
    # one after another: all of them are issued as the previous reader's are taken.
    runs = [list(run) for _, run in itertools.groupby(waits, key=first_reader)]
    for before, run in zip(runs, runs[1:]):
        previous = before[-1]
        for wait in reversed(run):  # each goes right after `previous`: run order
            start = wait.args[2]
            if position[start] > position[previous]:
                previous.append(start)
    gm.graph.lint()
    gm.recompile()
    return gm


# ---------------------------------------------------------------------------------------
# Which parameters, in which buckets


def _experts(gm: fx.GraphModule) -> set[int]:
    """id() of the stage's expert weights that expert parallelism split over ep."""
    fqns = EP_SHARDED.get(gm, frozenset())
    return {id(p) for name, p in gm.named_parameters(remove_duplicate=False) if name in fqns}


def _axes(groups: MeshGroups) -> str:
    return "dp×ep" if groups.size(Axis.EP) > 1 else Axis.DP.value


def _parameter_reads(
    gm: fx.GraphModule, whole: set[int]
) -> dict[int, tuple[nn.Parameter, list[fx.Node]]]:
    """id(parameter) -> (parameter, its get_attr nodes), for the parameters to shard:
    all but those other stages read too and those kept `whole`."""
    shared = _shared_with_other_stages(gm) | whole
    reads: dict[int, tuple[nn.Parameter, list[fx.Node]]] = {}
    for node, p in parameter_attributes(gm):
        if id(p) not in shared:
            reads.setdefault(id(p), (p, []))[1].append(node)
    for _, p in gm.named_parameters():  # read nowhere: sharded all the same
        if id(p) not in shared:
            reads.setdefault(id(p), (p, []))
    return reads


def _shared_with_other_stages(gm: fx.GraphModule) -> set[int]:
    if PIPELINE_KEY not in gm.meta:
        return set()
    fqns = {s.fqn for s in pipeline_info(gm).shared}
    return {id(p) for name, p in gm.named_parameters() if name in fqns}


def _buckets(
    gm: fx.GraphModule, reads: dict[int, tuple[nn.Parameter, list[fx.Node]]], experts: set[int]
) -> list[list[nn.Parameter]]:
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    first_use: dict[int, fx.Node | None] = {}
    for k, (_, nodes) in reads.items():
        users = [user for node in nodes for user in node.users]
        first_use[k] = min(users, key=position.__getitem__) if users else None
    order = sorted(reads, key=lambda k: position[first_use[k]] if first_use[k] else len(position))
    buckets: list[list[nn.Parameter]] = []
    last_key, size = None, 0
    for k in order:
        p = reads[k][0]
        # Unread parameters get no gradient: alone in a bucket, the optimizer skips them.
        read = first_use[k] is not None
        key = (_block(first_use[k]), read, k in experts, p.dtype, p.device, p.requires_grad)
        nbytes = p.numel() * p.element_size()
        if key != last_key or size + nbytes > ZERO3_BUCKET_BYTES:
            buckets.append([])
            last_key, size = key, 0
        buckets[-1].append(p)
        size += nbytes
    return buckets


def _block(node: fx.Node | None) -> str | None:
    info = BLOCK.get(node, None) if node is not None else None
    return info.instance if info is not None else None


def _gathered_with(
    gm: fx.GraphModule,
    reads: dict[int, tuple[nn.Parameter, list[fx.Node]]],
    where: dict[int, tuple[int, int]],
    count: int,
) -> list[tuple[int, ...]]:
    """For each of the `count` buckets, the other buckets read by the recomputed regions
    that read it: a recomputation needs all of its region's parameters at once."""
    bucket_of = {node: where[key][0] for key, (_, nodes) in reads.items() for node in nodes}
    together: list[set[int]] = [set() for _ in range(count)]
    for node in gm.graph.find_nodes(op="call_module"):
        if isinstance(gm.get_submodule(str(node.target)), Recomputed):
            read = {bucket_of[arg] for arg in node.all_input_nodes if arg in bucket_of}
            for b in read:
                together[b] |= read - {b}
    return [tuple(sorted(t)) for t in together]


def _canonical_names(gm: fx.GraphModule) -> dict[int, str]:
    """id(parameter) -> its first FQN (a tied parameter's other names are aliases)."""
    names: dict[int, str] = {}
    for name, p in gm.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def _remove_parameters(gm: fx.GraphModule, ids: set[int]) -> None:
    """Drop every attribute holding one of these parameters: the shards replace them."""
    for name, p in list(gm.named_parameters(remove_duplicate=False)):
        if id(p) in ids:
            module_path, _, leaf = name.rpartition(".")
            module = gm.get_submodule(module_path) if module_path else gm
            module._parameters.pop(leaf, None)


# ---------------------------------------------------------------------------------------
# Reads through gathers


@dataclass
class _Gather:
    """One all-gather of a bucket and the views taken from it."""

    serial: int
    wait: fx.Node
    views: dict[int, fx.Node] = field(default_factory=dict)  # index in bucket -> getitem


class _Reads:
    def __init__(self, gm: fx.GraphModule, module: ShardedParameters) -> None:
        self.gm, self.graph, self.module = gm, gm.graph, module
        first = next(n for n in self.graph.nodes if n.op != "placeholder")
        with self.graph.inserting_before(first):
            self.holder = self.graph.get_attr(ZERO3)
        PARAMS.set(self.holder, ())
        SHAPE.set(self.holder, None)
        self.latest: dict[int, _Gather] = {}
        self.serial = 0
        self.user_from = 0  # the serial before the user being rewritten gathered

    def rewrite(
        self,
        reads: dict[int, tuple[nn.Parameter, list[fx.Node]]],
        where: dict[int, tuple[int, int]],
    ) -> None:
        """Point every reader of a parameter at a view of its bucket's latest gather."""
        place = {node: where[key] for key, (_, nodes) in reads.items() for node in nodes}
        for user in list(self.graph.nodes):
            # A user reading many buckets (a recomputed region takes its parameters as
            # inputs) gathers them in bucket order, each once.
            attrs = dict.fromkeys(a for a in user.all_input_nodes if a in place)
            self.user_from = self.serial
            for attr in sorted(attrs, key=place.__getitem__):
                bucket, index = place[attr]
                user.replace_input_with(attr, self._view(bucket, index, attr, user))
        for attr in place:
            self.graph.erase_node(attr)

    def _view(self, bucket: int, index: int, attr: fx.Node, user: fx.Node) -> fx.Node:
        gather = self.latest.get(bucket)
        if gather is None or (
            self.serial - gather.serial >= ZERO3_REGATHER_AFTER and gather.serial <= self.user_from
        ):
            gather = self.latest[bucket] = self._gather(bucket, user)
        if index not in gather.views:
            with self.graph.inserting_before(user):
                view = self.graph.call_function(operator.getitem, (gather.wait, index))
            view.meta.update(attr.meta)
            PARAMS.set(view, ())
            gather.views[index] = view
        return gather.views[index]

    def _gather(self, bucket: int, user: fx.Node) -> _Gather:
        self.serial += 1
        layout = self.module.layouts[bucket]
        shard = self.module.shards[bucket]
        itemsize = shard.element_size()
        with self.graph.inserting_before(user):
            start = self.graph.create_node(
                "call_function",
                all_gather_start,
                (self.holder, bucket),
                name=f"zero3_all_gather_{bucket}",
            )
            wait = self.graph.create_node(
                "call_function",
                all_gather_wait,
                (self.holder, bucket, start),
                name=f"zero3_wait_{bucket}",
            )
        over = self.module.over[bucket]
        group, axis = over.name, over.axes
        info = CollectiveInfo("all_gather", axis, group, layout.shard_numel * itemsize)
        self._annotate(start, user, info)
        info = CollectiveInfo("reduce_scatter (backward)", axis, group, layout.padded * itemsize)
        self._annotate(wait, user, info)
        return _Gather(self.serial, wait)

    def _annotate(self, node: fx.Node, user: fx.Node, info: CollectiveInfo) -> None:
        inherit(node, user, shape=None)  # not tensors: a pending gather, a tuple of views
        COLLECTIVE.set(node, info)
