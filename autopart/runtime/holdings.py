"""What a rank holds of the model's whole parameters, and where each piece lies.

A ParallelModule's parameter values live in its stages' parameters (whole, or as their
tensor-parallel slices), in ZeRO-3's flat shards, and, under ZeRO-1/2, also in the flat
shards the optimizer steps (copies of the parameters' values). `Holdings` finds every
one of them and describes it as pieces of whole, named parameters (pieces.py); anything
laid out like one of them (its gradient, the optimizer's moments) has the same pieces.
Checkpoints (checkpoint.py) and `autopart.verify` read a rank's state through it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from autopart.degrees import Axis
from autopart.ops.flat_buckets import FlatLayout
from autopart.ops.zero3 import ZERO3, sharded_parameters
from autopart.runtime.pieces import (
    AxisSlices,
    Piece,
    Slices,
    distinct,
    flat_pieces,
    whole_pieces,
)
from autopart.runtime.zero import ZeroState
from autopart.runtime.zero_replicas import ReplicaShards

if TYPE_CHECKING:
    from autopart.runtime.parallel_module import ParallelModule


@dataclass(frozen=True, slots=True)
class Held:
    """A tensor this rank holds (a parameter, or a ZeRO shard) and where it lies."""

    names: tuple[str, ...]  # the parameters it holds pieces of
    first_size: tuple[int, ...]  # the whole shape of the first
    pieces: Callable[[torch.Tensor], list[Piece]]  # of any tensor laid out like it
    whole: bool  # one parameter, neither flat-sharded nor tensor-parallel


class Holdings:
    """Every tensor of a ParallelModule that holds parameter values, and its layout."""

    def __init__(self, pm: ParallelModule) -> None:
        tp = _slices(pm)
        self.own: list[tuple[torch.Tensor, Held]] = []  # each value written once
        self.copies: list[tuple[torch.Tensor, Held]] = []  # ZeRO-1/2 shards of those
        name_of: dict[int, str] = {}
        for gm in pm.stages:
            for name, p in gm.named_parameters():
                if not name.startswith(f"{ZERO3}."):
                    name_of[id(p)] = name
                    size = tp.whole_size(name, p.shape)
                    pieces = partial(whole_pieces, name, tp=tp)
                    self.own.append((p, Held((name,), size, pieces, name not in tp)))
            zero3 = sharded_parameters(gm)
            if zero3 is not None:
                for shard, names, layout, over in zip(
                    zero3.shards, zero3.names, zero3.layouts, zero3.over
                ):
                    self.own.append((shard, _flat(names, layout, over.rank, tp)))
        state = pm.state
        # Tensors holding 16-bit copies of fp32 master weights (on the host, or the
        # shards of 16-bit parameters), and those masters: what a checkpoint saves of
        # the weights instead.
        self.lowered: dict[int, torch.Tensor] = {}
        self.masters: list[tuple[torch.Tensor, Held]] = []
        for part in state.parts if isinstance(state, ZeroState) else ():
            if isinstance(part, ReplicaShards):
                shard_rank = dist.get_rank(part.group)  # dp, or dp x ep under ep
                for bucket in part.buckets:
                    of_bucket = [name_of[id(p)] for p in bucket.params]
                    copy = _flat(of_bucket, bucket.layout, shard_rank, tp)
                    self.copies.append((bucket.shard, copy))
                    if part.compute_dtype is not None:
                        self.lowered.update((id(p), p) for p in bucket.params)
                        self.masters.append((bucket.shard, copy))
        self._by_id = {id(t): held for t, held in (*self.own, *self.copies)}
        offloaded = state.offloaded if state else None  # the host copies the optimizer steps
        self.lowered.update(offloaded.lowered if offloaded else {})
        for tensor, host in zip(offloaded.tensors, offloaded.host) if offloaded else ():
            if id(tensor) in self._by_id:
                held = self._by_id[id(tensor)]
                self.copies.append((host, held))
                self._by_id[id(host)] = held
                if id(tensor) in self.lowered:
                    self.masters.append((host, held))

    def of(self, tensor: torch.Tensor) -> Held:
        return self._by_id[id(tensor)]

    def parameters(self, loading: bool) -> dict[str, list[Piece]]:
        """Each parameter's pieces on this rank. For saving, each box once, from the
        master weights where the device holds 16-bit copies; for loading, every view
        that must receive it, ZeRO-1/2's flat shards and the host's copies included
        (they hold copies of the parameters' values)."""
        entries: dict[str, list[Piece]] = {}
        held = (
            [*self.own, *self.copies]
            if loading
            else [(t, h) for t, h in self.own if id(t) not in self.lowered] + self.masters
        )
        for tensor, held_as in held:
            for piece in held_as.pieces(tensor.detach()):
                entries.setdefault(piece.name, []).append(piece)
        if loading:
            return entries
        return {name: distinct(pieces) for name, pieces in entries.items()}


def _slices(pm: ParallelModule) -> Slices:
    """How this rank's slices sit in whole parameters: under expert parallelism its run
    of every layer's experts (dim 0), cut from tp's slices."""
    experts = {name: (0, 1) for name in pm.ep_sharded}
    return Slices(
        (
            AxisSlices(experts, pm.plan.ep, pm.groups.rank(Axis.EP)),
            AxisSlices(pm.tp_layout, pm.plan.tp, pm.groups.rank(Axis.TP)),
        )
    )


def _flat(names: Sequence[str], layout: FlatLayout, rank: int, tp: Slices) -> Held:
    pieces = partial(flat_pieces, names=names, layout=layout, rank=rank, tp=tp)
    return Held(tuple(names), tp.whole_size(names[0], layout.shapes[0]), pieces, False)
