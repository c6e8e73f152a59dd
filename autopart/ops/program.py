"""What the rewrite hands the runtime: this rank's program."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx, nn

from autopart.ops.loss_match import CrossEntropy
from autopart.ops.zero3 import ZERO3, sharded_parameters


@dataclass
class RankProgram:
    """This rank's stage graphs: the whole graph when pp = 1; with a pipeline, the
    stages this rank runs (several under an interleaved schedule), by stage index."""

    stages: list[fx.GraphModule]
    stage_ids: list[int]
    # Tensor-parallel parameters: FQN -> (sharded dim, parts of a fused weight).
    tp_layout: dict[str, tuple[int, int]] = field(default_factory=dict)
    # The loss, where the last stage returns its logits sharded over the vocabulary
    # (tp's last dim): the runtime computes it with a vocabulary-parallel cross-entropy.
    vocab_parallel_loss: CrossEntropy | None = None
    # Parameters whose gradient each cp rank holds a part of, for the data-parallel
    # sync to sum over cp (`policy.cp_gradients_in_sync`).
    cp_summed: frozenset[str] = frozenset()
    # Stacked expert weights split over ep (dim 0): their gradient syncs over dp only.
    ep_sharded: frozenset[str] = frozenset()


class ProgramMismatch(ValueError):
    """A program made again that does not hold what the first one holds."""


def sharing_tensors(program: RankProgram, held: RankProgram) -> RankProgram:
    """`program`, rewritten under the same plan as `held` for inputs of another shape,
    made to hold `held`'s tensors: each stage's parameters, buffers and ZeRO-3 shards
    become the objects `held`'s stage holds under the same name. The optimizer, the
    gradient hooks and the checkpoints, all built over `held`, then serve both, and a
    step of either trains the same values. The tensors `program` was rewritten with
    (slices of the model's stale whole parameters) are dropped."""
    if (
        program.stage_ids != held.stage_ids
        or program.tp_layout != held.tp_layout
        or program.cp_summed != held.cp_summed
        or program.ep_sharded != held.ep_sharded
    ):
        raise ProgramMismatch(
            f"the program made again runs stages {program.stage_ids} with tensor-parallel "
            f"layout {program.tp_layout}, the first {held.stage_ids} with {held.tp_layout}"
        )
    for stage, kept in zip(program.stages, held.stages):
        _share_stage(stage, kept)
    return program


def _share_stage(stage: fx.GraphModule, kept: fx.GraphModule) -> None:
    shards, kept_shards = sharded_parameters(stage), sharded_parameters(kept)
    if shards is not None or kept_shards is not None:
        if shards is None or kept_shards is None or shards.names != kept_shards.names:
            raise ProgramMismatch("the program made again buckets ZeRO-3's shards otherwise")
        setattr(stage, ZERO3, kept_shards)  # its hooks find the stage's shards as it runs
    tensors = [
        *stage.named_parameters(remove_duplicate=False),
        *stage.named_buffers(remove_duplicate=False),
    ]
    for name, tensor in tensors:
        _replace(stage, name, _kept(kept, name, tensor))


def _kept(kept: fx.GraphModule, name: str, tensor: torch.Tensor) -> torch.Tensor:
    getter = kept.get_parameter if isinstance(tensor, nn.Parameter) else kept.get_buffer
    try:
        value: torch.Tensor | None = getter(name)
    except AttributeError:
        value = None
    if value is None or value.shape != tensor.shape or value.dtype != tensor.dtype:
        raise ProgramMismatch(
            f"the program made again holds {name!r} of shape {tuple(tensor.shape)}, which "
            "the first program does not hold as such"
        )
    return value


def _replace(stage: fx.GraphModule, name: str, value: torch.Tensor) -> None:
    module_path, _, leaf = name.rpartition(".")
    module = stage.get_submodule(module_path) if module_path else stage
    if isinstance(value, nn.Parameter):
        module._parameters[leaf] = value
    else:
        module._buffers[leaf] = value
