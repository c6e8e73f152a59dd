"""Pipeline split: the (possibly tensor-parallel) graph → one module per pipeline stage.

Policy stays apart from mechanics:

* `assign_stages` decides. The plan's cuts are module paths where stages 1, 2, ... begin;
  an operator belongs to the stage of the last cut reached at or before it in graph
  order, so stages follow the graph and values only flow forward.
* `recompute_where_used` prepares. A value that depends on no trainable parameter
  (position ids, masks, rotary tables, sizes) is computed again in each later stage that
  uses it instead of being sent: it is cheap, needs no gradient, and a size (a SymInt)
  could not be sent at all. The model inputs it starts from travel along the pipeline.
* `torch.fx.passes.split_module` splits, with the assignment as its callback.
* `stage_modules.build_stage_modules` turns the partitions into runnable stage modules.

Rank r of the pp axis runs stages r, r + pp, r + 2·pp, ... (torch.distributed.pipelining's
placement for interleaved schedules; one stage per rank otherwise).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

from autopart.degrees import Axis
from autopart.ops.meta import MODULE_PATH
from autopart.passes.runner import PassContext
from autopart.passes.stage_modules import build_stage_modules
from autopart.plan import PlanError

_CALLS = ("call_function", "call_method", "call_module")


def split_stages(gm: fx.GraphModule, ctx: PassContext) -> tuple[list[fx.GraphModule], list[int]]:
    """The stage modules this rank runs, and their stage indices: the plan's
    `stage_cuts`, this rank's place on the pp axis. Each stage keeps what earlier
    rewrite passes recorded in `gm.meta` (the tensor-parallel layout)."""
    plan, groups = ctx.rank.plan, ctx.rank.groups
    stages = pipeline_stages(gm, plan.stage_cuts, ctx)
    ids = list(range(groups.rank(Axis.PP), len(stages), groups.size(Axis.PP)))
    decided = {k: v for k, v in gm.meta.items() if k.startswith("autopart.")}
    for i in ids:
        stages[i].meta.update(decided)
    return [stages[i] for i in ids], ids


def pipeline_stages(
    gm: fx.GraphModule, cuts: tuple[str, ...], ctx: PassContext
) -> list[fx.GraphModule]:
    """Every stage, in order: `stages[0](*model_args)` returns the inputs of
    `stages[1]`, and so on; the last returns the model's output."""
    work = _canonical_copy(gm, ctx.params)
    trainable = {
        ctx.params.get(name, name)
        for name, p in gm.named_parameters(remove_duplicate=False)
        if p.requires_grad
    }
    stage_of = assign_stages(work.graph, cuts)
    recompute_where_used(work.graph, stage_of, trainable)
    _check_no_empty_stage(stage_of, cuts)
    split = split_module(work, work, stage_of.__getitem__, keep_original_node_name=True)
    return build_stage_modules(gm, work, split, stage_of, len(cuts) + 1, trainable)


def assign_stages(graph: fx.Graph, cuts: tuple[str, ...]) -> dict[fx.Node, int]:
    """The stage of every operator (and of the output: the last stage)."""
    stage_of: dict[fx.Node, int] = {}
    stage = 0
    for node in graph.nodes:
        if node.op == "output":
            stage_of[node] = len(cuts)
        elif node.op in _CALLS:
            # Nodes a rewrite pass inserted may carry no module path: they stay with the
            # stage of the operators before them.
            path = MODULE_PATH.get(node, "")
            for i in range(stage, len(cuts)):
                if path == cuts[i] or path.startswith(cuts[i] + "."):
                    stage = i + 1
            stage_of[node] = stage
    return stage_of


def recompute_where_used(
    graph: fx.Graph, stage_of: dict[fx.Node, int], trainable: set[str]
) -> None:
    """Give each later stage that uses a parameter-free value its own copy of the
    operators computing it, placed at the start of that stage."""
    free = _parameter_free(graph, trainable)
    first: dict[int, fx.Node] = {}
    for node in graph.nodes:
        if node in stage_of:
            first.setdefault(stage_of[node], node)
    copies: dict[tuple[fx.Node, int], fx.Node] = {}

    def local(value: fx.Node, stage: int) -> fx.Node:
        if value not in stage_of or stage_of[value] == stage:  # inputs, attributes
            return value
        if (value, stage) not in copies:
            with graph.inserting_before(first[stage]):
                copy = graph.node_copy(value, lambda arg: local(arg, stage))
            stage_of[copy] = stage
            copies[(value, stage)] = copy
        return copies[(value, stage)]

    originals = [n for n in graph.nodes if n in free and n in stage_of]
    had_users = {n for n in originals if n.users}
    for node in originals:
        for user in list(node.users):
            if stage_of[user] != stage_of[node]:
                user.replace_input_with(node, local(node, stage_of[user]))
    for node in reversed(originals):  # users first, so unused chains go whole
        if node in had_users and not node.users:
            graph.erase_node(node)
            del stage_of[node]


def _parameter_free(graph: fx.Graph, trainable: set[str]) -> set[fx.Node]:
    """Operators computable anywhere from the model inputs and buffers: no trainable
    parameter upstream, and no random number drawn (a copy would draw others)."""
    free: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op in ("call_function", "call_method"):
            computable = not _draws_random(node) and all(a in free for a in node.all_input_nodes)
        else:
            computable = node.op == "placeholder" or (
                node.op == "get_attr" and node.target not in trainable
            )
        if computable:
            free.add(node)
    return {n for n in free if n.op in ("call_function", "call_method")}


def _draws_random(node: fx.Node) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def _canonical_copy(gm: fx.GraphModule, params: Mapping[str, str]) -> fx.GraphModule:
    """A copy of `gm` whose attribute reads name each parameter by its canonical FQN, so
    tied weights are one parameter under one name in every stage."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
        if node.op == "get_attr":
            env[node].target = params.get(str(node.target), node.target)
    return fx.GraphModule(gm, graph)


def _check_no_empty_stage(stage_of: dict[fx.Node, int], cuts: tuple[str, ...]) -> None:
    present = {stage for node, stage in stage_of.items() if node.op != "output"}
    for stage in range(len(cuts) + 1):
        if stage not in present:
            begins = f"at {cuts[stage - 1]!r}" if stage else "at the start"
            raise PlanError(
                f"pipeline stage {stage} (beginning {begins}) would hold no operator: each "
                f"stage cut must name a module of the model, in the order the model runs "
                f"them (cuts: {list(cuts)})"
            )
