"""The one-line entry points. They only sequence the stages:
capture → analyze → solve → rewrite → run. Each stage lives in its own package."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autopart.batch import batch_size, split_batch
from autopart.capture import Captured, capture, parameters_in
from autopart.heap import young_collections_only
from autopart.mesh import Mesh
from autopart.ops.batch_products import ROWS, WHOLE, WholeBatchLoss, loss_by_rows
from autopart.ops.groups import MeshGroups
from autopart.ops.loss_match import CrossEntropy, match_cross_entropy
from autopart.ops.meta import TensorInfo
from autopart.ops.program import RankProgram, sharing_tensors
from autopart.passes import analyze
from autopart.passes.batch_mixing import gathered_products
from autopart.passes.materialize import Weights, materialize_pass
from autopart.passes.rewrite import rank_program
from autopart.passes.runner import RankTarget, pass_name
from autopart.plan import Plan, PlanError
from autopart.policy import (
    COLLECTIVE_TIMEOUT_S,
    LOW_DTYPES,
    PARAM_DTYPES,
    MasterWeights,
    optimizer_class,
    optimizer_refusal,
    zero_refusal,
)
from autopart.runtime.parallel_module import LossFn, OptimizerFactory, ParallelModule
from autopart.runtime.training import TrainingOptions
from autopart.solver import Pins, make_plan, recompute_refusal
from autopart.stack_expansion import capture_repeated_once


def plan(
    model: nn.Module,
    mesh: Mesh,
    example_inputs: Any,
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    loss_fn: LossFn | None = None,
    **pins: Any,
) -> Plan:
    """Choose how to run `model` on `mesh` for the global batch `example_inputs`. With
    the `loss_fn` training will use, a standard cross-entropy is priced as it will run:
    on logits left sharded over the vocabulary where the layout shards them.

    Pins, each left to the solver when None: every mesh axis by name (`dp`, `tp`, `pp`),
    `zero`, `microbatches`, `schedule`, `virtual_stages`, `recompute` (module paths of
    blocks, "all", "none", or "attention" for every block's attention core alone),
    `recompute_attention` (module paths); `precision` ("fp32", "bf16-mixed",
    "fp16-mixed", "bf16-params", or "bf16-auto": the solver's choice of bf16-mixed or
    bf16-params), `sequence_parallel`, and `compile` (the plan priced as programs
    compiled by inductor, as `parallelize(..., compile=True)` runs them)."""
    with young_collections_only():  # one block for the capture and the search
        captured_in = _captures(model, example_inputs, example_kwargs, repeated_once=True)
        captured = captured_in(_param_dtype(None, pins))
        loss = match_cross_entropy(loss_fn, captured.gm) if loss_fn else None
        products = _product_loss(loss_fn, captured)
        return make_plan(
            captured,
            mesh,
            Pins.of(sharded_logits=loss and loss.logits, batch_product_loss=products, **pins),
            captured_in,
        )


def parallelize(
    model: nn.Module,
    mesh: Mesh,
    example_inputs: Any,
    *,
    loss_fn: LossFn | None = None,
    optimizer: OptimizerFactory | None = None,
    plan: Plan | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    weights: Weights | None = None,
    timeout: float | timedelta = COLLECTIVE_TIMEOUT_S,
    max_grad_norm: float | None = None,
    batch: str = "global",
    skip_nonfinite: bool = False,
    compile: bool | None = None,
    **pins: Any,
) -> ParallelModule:
    """Capture, plan (unless `plan` is given), rewrite and return the per-rank module.
    The model's parameters are trained in place where they are not sharded. A model
    built on the meta device (`autopart.init_empty_weights()`) takes its `weights` from
    a state dict of whole tensors or a torch.distributed.checkpoint directory; each
    rank loads only its own pieces. A collective that waits more than `timeout`
    (seconds, or a timedelta) for a peer fails the step on every rank that waits: a
    peer that stopped responding stops the job instead of hanging it.

    Training options, which leave the plan as it is (runtime/training.py):
    `max_grad_norm` clips each step's gradients to that global norm; `batch` says what
    each rank passes to `train_step`, "global" (the global batch, the same on every
    rank) or "per_rank" (each data-parallel rank its own share, as under DDP); a step
    whose loss or gradient norm is not finite is skipped, and raises NonFiniteLoss
    unless `skip_nonfinite`.

    `compile` runs each rank's programs compiled by inductor, and the plan is chosen and
    priced so (`Plan.compiled`); None: as the given plan says, else eagerly. A plan
    given with the other mode runs as asked, its predictions marked as priced for the
    mode it was made for (`plan.explain()` says so)."""
    captured_in = _captures(model, example_inputs, example_kwargs)
    captured = captured_in(_param_dtype(plan, pins))
    kind = optimizer_class(optimizer) if optimizer else None
    refusal = optimizer_refusal(kind)
    if refusal:
        raise TypeError(refusal)
    # A standard cross-entropy may run on logits sharded over the vocabulary, and its
    # mean over counted tokens weighs the batch's parts by their counts.
    loss = match_cross_entropy(loss_fn, captured.gm) if loss_fn else None
    if plan is None:
        logits = loss and loss.logits
        products = _product_loss(loss_fn, captured)
        plan = make_plan(
            captured,
            mesh,
            Pins.of(
                optimizer_class=kind,
                sharded_logits=logits,
                batch_product_loss=products,
                compile=bool(compile),
                **pins,
            ),
            captured_in,
        )
        if captured is not (chosen := captured_in(_param_dtype(plan, {}))):
            captured = chosen  # the capture of the mode the solver chose
            loss = match_cross_entropy(loss_fn, captured.gm) if loss_fn else None
    elif pins:
        raise TypeError(f"pass either a plan or pins, not both (got pins {sorted(pins)})")
    if compile is not None and compile != plan.compiled:
        plan = plan.with_changes(compiled=compile)
    training = TrainingOptions(max_grad_norm, batch, skip_nonfinite, plan.compiled)
    plan.check_compatible(captured.fingerprint, mesh)
    refusal = (
        zero_refusal(plan.zero, kind)
        or _host_masters_refusal(plan, captured, model)
        or _clipping_refusal(plan, training)
        or recompute_refusal(captured.gm, plan.recompute, plan.recompute_attention)
    )
    if refusal:
        raise PlanError(refusal)
    limit = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
    groups = MeshGroups(mesh.device_mesh(plan.degrees, limit), mesh.group_options(limit))
    if plan.tp * plan.degrees.batch_split * plan.microbatches == 1:
        loss = None  # the batch is not split: the user's loss runs as it is
    if loss_fn is not None and plan.batch_product_loss == WHOLE:
        loss_fn = WholeBatchLoss(loss_fn, groups.batch_group().group_name)
    target = RankTarget(plan, groups, weights, loss)
    program = _rank_program(model, captured, example_kwargs, target)
    shapes, ranges = captured.input_shapes(), captured.dim_ranges
    example = captured.example_args
    again = functools.partial(
        _program_again, model, plan, groups, example_kwargs, loss, program, example
    )
    return ParallelModule(
        program,
        plan,
        groups,
        loss_fn,
        optimizer,
        shapes,
        ranges,
        again,
        recognized_loss=loss,
        training=training,
        example_batch=batch_size((captured.example_args, captured.example_kwargs)),
    )


def _product_loss(loss_fn: LossFn | None, captured: Captured) -> str:
    """What the loss gets of a batch × batch product where the batch is split: its rows,
    where the loss is a mean over them, else the whole (ops/batch_products.py)."""
    if loss_fn is None or not gathered_products(captured.gm):
        return WHOLE
    batch = batch_size((captured.example_args, captured.example_kwargs))
    return ROWS if loss_by_rows(loss_fn, captured.gm, batch) else WHOLE


def _clipping_refusal(plan: Plan, training: TrainingOptions) -> str | None:
    """Why the step cannot clip as asked, or None: under local SGD each replica steps on
    its own gradients, and one global norm over them is no norm any replica has."""
    if training.max_grad_norm is None or plan.sync_every is None:
        return None
    return (
        "max_grad_norm does not combine with local SGD (sync_every): each replica steps "
        "on its own gradients. Clip without sync_every, or train local SGD unclipped"
    )


def _host_masters_refusal(plan: Plan, captured: Captured, model: nn.Module) -> str | None:
    """Why this model cannot keep its master weights on the host, or None: they are fp32
    copies of fp32 parameters, and the graph pass that widens the device's 16-bit
    copies reads torch.export's operators (passes/master_weights.py)."""
    if plan.master_weights != MasterWeights.HOST:
        return None
    if captured.frontend != "export":
        return (
            f"master_weights='host' needs a torch.export capture, and this model was "
            f"captured by {captured.frontend}: keep master_weights='device'"
        )
    narrow = [
        n for n, p in model.named_parameters() if p.requires_grad and p.dtype != torch.float32
    ]
    if narrow:
        return (
            f"master_weights='host' keeps fp32 masters of fp32 parameters, and {narrow[0]} "
            f"is {model.get_parameter(narrow[0]).dtype}: build the model in fp32"
        )
    return None


def _as_captured(model: nn.Module, plan: Plan) -> contextlib.AbstractContextManager[None]:
    """`model` with its trained parameters in fp32 (and no gradients) while it is
    captured again, where the plan keeps master weights on the host and they hold the
    device's 16-bit copies: the capture then records the dtypes the first program was
    made for."""
    host = plan.master_weights == MasterWeights.HOST
    return parameters_in(model, torch.float32 if host else None, trained_only=True)


def _rank_program(
    model: nn.Module,
    captured: Captured,
    example_kwargs: Any,
    target: RankTarget,
    disabled: frozenset[str] = frozenset(),
) -> RankProgram:
    """This rank's program of the target's plan: the capture it runs, rewritten."""
    runs = _program_capture(model, captured, target.plan, example_kwargs, target.groups.device)
    return rank_program(runs.gm, runs.context(target=target, disabled=disabled))


def _program_again(
    model: nn.Module,
    plan: Plan,
    groups: MeshGroups,
    example_kwargs: Any,
    loss: CrossEntropy | None,
    held: RankProgram,
    example_inputs: tuple,
    inputs: tuple | None = None,
    *,
    evaluating: bool = False,
) -> tuple[RankProgram, tuple[TensorInfo | None, ...], dict[str, tuple[int, float]]]:
    """This rank's program of `plan` for inputs of other shapes than the example's,
    which the program `held` does not take (None: the example's), or `evaluating`
    (the model in eval mode): `model` captured again, rewritten as `held` was, and
    given `held`'s tensors (trained since; not loaded again from the weights), with
    the inputs it takes."""
    with _as_captured(model, plan), _in_mode(model, evaluating):
        captured = captured_for_planning(
            model,
            example_inputs if inputs is None else inputs,
            example_kwargs,
            param_dtype=_param_dtype(plan, {}),
        )
        target = RankTarget(plan, groups, loss=loss)
        program = _rank_program(model, captured, example_kwargs, target, _KEEPS_TENSORS)
    return sharing_tensors(program, held), captured.input_shapes(), captured.dim_ranges


# A program made again takes the first one's tensors: no weights are loaded into it.
_KEEPS_TENSORS = frozenset({pass_name(materialize_pass)})


@contextlib.contextmanager
def _in_mode(model: nn.Module, evaluating: bool) -> Iterator[None]:
    """`model` in eval mode while it is captured, where `evaluating`: dropout and batch
    normalization are traced as `model.eval()` runs them. Each module's own mode comes
    back after (a model may hold some modules in eval mode while it trains)."""
    modes = [(module, module.training) for module in model.modules()]
    if evaluating:
        model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def captured_for_planning(
    model: nn.Module,
    example_inputs: Any,
    example_kwargs: Any = None,
    autocast: Any = None,
    param_dtype: torch.dtype | None = None,
    *,
    repeated_once: bool = False,
) -> Captured:
    """`model` captured and analyzed, as `plan` and `parallelize` see it. A model on the
    meta device is captured at its example batch, static: it runs at no batch (its
    ranks trace it again at theirs, `_program_capture`), the cost models scale a static
    batch to any microbatch, and torch.export traces it in half the time. With
    `repeated_once` (planning alone) the main repeated stack's first blocks are traced
    and the rest copied from them (`stack_expansion`): the same graph, in less time."""
    params = list(model.parameters())
    on_meta = bool(params) and all(p.is_meta for p in params)
    if params and not on_meta:  # example inputs on another device (a GPU's, a CPU
        # model's) trace as the model's own: planning reads their shapes alone
        example_inputs, example_kwargs = _on_device(
            (example_inputs, example_kwargs), params[0].device
        )
    trace = capture_repeated_once if repeated_once else capture
    # The analysis runs the graph on the parameters in `param_dtype` too.
    with parameters_in(model, param_dtype), young_collections_only():
        captured = trace(
            model,
            example_inputs,
            example_kwargs,
            autocast=autocast,
            param_dtype=param_dtype,
            dynamic_batch=not on_meta,
        )
        analyze(captured.gm, captured.context())
    return captured


def _on_device(tree: Any, device: torch.device) -> Any:
    """`tree` with its tensors on `device` (meta tensors stay: they hold no values)."""
    return pytree.tree_map_only(
        torch.Tensor, lambda t: t if t.is_meta or t.device == device else t.to(device), tree
    )


def _program_capture(
    model: nn.Module, captured: Captured, plan: Plan, example_kwargs: Any, device: torch.device
) -> Captured:
    """The capture the ranks run. The planning capture serves unless the program must be
    traced again: under autocast for mixed precision (code that reads a tensor's dtype,
    `.to(x.dtype)`, then records the low dtype), on the rank's accelerator (whose autocast
    casts differently from the CPU's), or at the per-rank batch when the model
    specialized on the batch size."""
    inputs = captured.example_args
    parts = plan.degrees.batch_split * plan.microbatches
    specialized = not captured.admits_batch(batch_size(inputs) // parts)
    if specialized:
        inputs = split_batch(inputs, 0, parts)
    autocast = LOW_DTYPES.get(plan.precision)
    on_device = device.type != "cpu" and not any(p.is_meta for p in model.parameters())
    if on_device:
        model.to(device)
        inputs = _on_device(inputs, device)
    if specialized or autocast is not None or on_device:
        param_dtype = PARAM_DTYPES.get(plan.precision)
        return captured_for_planning(
            model, inputs, example_kwargs, autocast=autocast, param_dtype=param_dtype
        )
    return captured


def _captures(
    model: nn.Module, example_inputs: Any, example_kwargs: Any, *, repeated_once: bool = False
) -> Callable[[torch.dtype | None], Captured]:
    """`captured_for_planning` of `model` with its parameters in a dtype (None: as
    built), each made once: a precision the solver chooses plans each mode on its own
    capture, and the chosen one runs."""
    made: dict[torch.dtype | None, Captured] = {}

    def captured_in(dtype: torch.dtype | None) -> Captured:
        if dtype not in made:
            made[dtype] = captured_for_planning(
                model,
                example_inputs,
                example_kwargs,
                param_dtype=dtype,
                repeated_once=repeated_once,
            )
        return made[dtype]

    return captured_in


def _param_dtype(plan: Plan | None, pins: Mapping[str, Any]) -> torch.dtype | None:
    """The dtype the model is captured in: its parameters' under a 16-bit-parameter
    precision, planned or pinned; None (as built) otherwise."""
    precision = plan.precision if plan is not None else pins.get("precision")
    return PARAM_DTYPES.get(str(precision))
