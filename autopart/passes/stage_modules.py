"""Stage modules: the partitions `split_module` made, as modules that each run one
pipeline stage.

torch.distributed.pipelining sends a stage's outputs to the next stage only, so a stage
takes every value live into it (in graph order) and returns every value live out of it,
passing along what later stages need. The first stage takes the model's own inputs
(`stages[0](*args)` as `model(*args)`); the last returns the model's output structure,
so the user's loss function applies to it unchanged; in between, plain tensors.

Parameters keep their original FQNs and nodes keep their analysis meta. A parameter
read by several stages (tied embeddings) belongs to the first of them, its owner; every
later reader holds a replica: a buffer under the same FQN that requires grad, whose value
and gradient the runtime keeps in step with the owner's (runtime/shared_params.py).
Each stage module carries a `PipelineInfo` in `gm.meta`.
"""

from __future__ import annotations

import torch
from torch import fx, nn
from torch.fx.graph import CodeGen, _PyTreeCodeGen, _PyTreeInfo
from torch.utils import _pytree as pytree

from autopart.ops.meta import CP_PLACE, SHAPE, TensorInfo
from autopart.ops.stage_info import (
    PIPELINE_KEY,
    PipelineInfo,
    SharedParameter,
    output_values,
)
from autopart.plan import PlanError


def build_stage_modules(
    gm: fx.GraphModule,
    work: fx.GraphModule,
    split: fx.GraphModule,
    stage_of: dict[fx.Node, int],
    count: int,
    trainable: set[str],
) -> list[fx.GraphModule]:
    """`gm` is the captured graph (its calling convention and parameters), `work` the
    copy that was split into `split`'s `submod_<stage>` partitions."""
    live = _live_values(work.graph, stage_of, count)
    grads = _carries_grad(work.graph, trainable)
    pytree_info = getattr(gm.graph._codegen, "pytree_info", None)
    stages = []
    for k in range(count):
        part = split.get_submodule(f"submod_{k}")
        assert isinstance(part, fx.GraphModule), "split_module makes each partition a GraphModule"
        outputs = live[k + 1] if k + 1 < count else None
        stages.append(_stage_module(work, part, live[k], outputs, k, pytree_info))
    shared = _share_parameters(stages)
    _adopt_unread_parameters(gm, stages)
    model_inputs = tuple(SHAPE.get(v) for v in live[0])
    for k, stage in enumerate(stages):
        outputs = live[k + 1] if k + 1 < count else output_values(work.graph)
        stage.meta[PIPELINE_KEY] = PipelineInfo(
            k,
            count,
            model_inputs,
            tuple(grads[v] for v in live[k]),
            tuple(grads[v] for v in outputs),
            shared,
        )
    return stages


def _live_values(graph: fx.Graph, stage_of: dict[fx.Node, int], count: int) -> list[list[fx.Node]]:
    """live[k]: the values stage k receives, in graph order. Stage 0 receives the model's
    inputs; later stages whatever an earlier stage (or the input) made and it or a later
    stage uses."""
    live: list[list[fx.Node]] = [[n for n in graph.nodes if n.op == "placeholder"]]
    live += [[] for _ in range(count - 1)]
    for node in graph.nodes:
        if node.op in ("get_attr", "output") or not node.users:
            continue
        born = 0 if node.op == "placeholder" else stage_of[node]
        for k in range(born + 1, max(stage_of[u] for u in node.users) + 1):
            if _dtype(node) is None:
                raise PlanError(
                    f"{node.name} ({type(node.meta.get('val')).__name__}) is made in "
                    f"pipeline stage {born} and needed in stage {k}, but only tensors can "
                    "pass between stages: move the stage cut"
                )
            live[k].append(node)
    return live


def _carries_grad(graph: fx.Graph, trainable: set[str]) -> dict[fx.Node, bool]:
    """Floating-point values downstream of a trainable parameter (conservatively: a
    gradient that turns out to be None is sent as zeros)."""
    upstream: dict[fx.Node, bool] = {}
    for node in graph.nodes:
        if node.op == "get_attr":
            upstream[node] = node.target in trainable
        else:
            upstream[node] = any(upstream[a] for a in node.all_input_nodes)
    return {
        node: flag and (dtype := _dtype(node)) is not None and dtype.is_floating_point
        for node, flag in upstream.items()
    }


def _dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype of the one tensor `node` makes, or None if it makes none. Nodes a rewrite
    inserted (a tensor-parallel collective, a bias added after a reduction) carry their
    shape (`SHAPE`) but no traced value."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.dtype
    info = SHAPE.get(node, None)
    return info.dtype if isinstance(info, TensorInfo) else None


def _stage_module(
    work: fx.GraphModule,
    part: fx.GraphModule,
    inputs: list[fx.Node],
    outputs: list[fx.Node] | None,
    k: int,
    pytree_info: _PyTreeInfo | None,
) -> fx.GraphModule:
    """Stage k: the partition's operators, inlined between the live-in placeholders
    and the live-out outputs (`outputs` None: the model's output, for the last stage)."""
    originals = {n.name: n for n in work.graph.nodes}
    template = next(n for n in work.graph.nodes if n.op == "placeholder")
    graph = fx.Graph()
    by_name: dict[str, fx.Node] = {}  # original value name -> node in the stage
    for value in inputs:
        by_name[value.name] = graph.placeholder(value.name)
        by_name[value.name].meta = _input_meta(value, template)
    env: dict[fx.Node, fx.Node] = {}
    for node in part.graph.nodes:
        if node.op == "output":
            continue
        if node.op == "placeholder" and node.name in by_name:
            env[node] = by_name[node.name]
        elif node.op == "placeholder":  # a parameter or buffer split_module passed in
            original = originals[node.name]
            env[node] = graph.get_attr(str(original.target))
            env[node].meta = dict(original.meta)
        else:
            env[node] = by_name[node.name] = graph.node_copy(node, env.__getitem__)
    (work_output,) = work.graph.find_nodes(op="output")
    if outputs is None:
        result = fx.map_arg(work_output.args[0], lambda v: by_name[v.name])
    else:
        result = tuple(by_name[v.name] for v in outputs)
    graph.output(result).meta = dict(work_output.meta)
    graph._codegen = _codegen(pytree_info, k == 0, outputs is None, [v.name for v in inputs])
    return fx.GraphModule(work, graph, class_name=f"PipelineStage{k}")


def _input_meta(value: fx.Node, template: fx.Node) -> dict:
    """A stage input's meta: what every analysis says of an input (the model input
    `template`'s), with the value's own fake tensor, shape and placement over cp."""
    meta = {k: v for k, v in template.meta.items() if k.startswith("autopart.")}
    for key in ("val", "tensor_meta", SHAPE.key, CP_PLACE.key):
        if key in value.meta:
            meta[key] = value.meta[key]
    return meta


def _codegen(info: _PyTreeInfo | None, first: bool, last: bool, names: list[str]) -> CodeGen:
    """The first stage is called as the model is; the last returns the model's output
    structure; in between, plain tensors in and out."""
    if info is None or not (first or last):
        return CodeGen()
    in_spec = info.in_spec if first else pytree.tree_structure((tuple(names), {}))
    args = info.orig_args if first else names
    return _PyTreeCodeGen(_PyTreeInfo(args, in_spec, info.out_spec if last else None))


def _share_parameters(stages: list[fx.GraphModule]) -> tuple[SharedParameter, ...]:
    holders: dict[str, list[int]] = {}
    for k, stage in enumerate(stages):
        for fqn, _ in stage.named_parameters():
            holders.setdefault(fqn, []).append(k)
    shared = []
    for fqn, ks in sorted(holders.items()):
        if len(ks) > 1:
            for k in ks[1:]:
                _make_replica(stages[k], fqn)
            shared.append(SharedParameter(fqn, ks[0], tuple(ks[1:])))
    return tuple(shared)


def _make_replica(stage: fx.GraphModule, fqn: str) -> None:
    if not stage.graph.find_nodes(op="get_attr", target=fqn):
        raise PlanError(
            f"parameter {fqn} is read by several pipeline stages, one of them through a "
            "leaf module: capture the model with torch.export so stages read it by name"
        )
    prefix, _, name = fqn.rpartition(".")
    holder = stage.get_submodule(prefix)  # a module GraphModule made for this stage
    param = getattr(holder, name)
    delattr(holder, name)
    replica = param.detach().clone().requires_grad_(param.requires_grad)
    holder.register_buffer(name, replica, persistent=False)


def _adopt_unread_parameters(gm: fx.GraphModule, stages: list[fx.GraphModule]) -> None:
    """Parameters no operator reads go to the first stage, so that the optimizer and
    full_state_dict still see every parameter of the model."""
    held = {fqn for stage in stages for fqn, _ in stage.named_parameters()}
    held |= {fqn for stage in stages for fqn, _ in stage.named_buffers()}
    for fqn, param in gm.named_parameters():
        if fqn in held:
            continue
        *path, name = fqn.split(".")
        module: nn.Module = stages[0]
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_parameter(name, param)
