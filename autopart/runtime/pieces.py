"""Where a rank's tensors lie in the model's whole tensors: the geometry of checkpoints.

A rank holds pieces of whole parameters (and of optimizer state shaped like them) in
two forms:

    whole     a parameter as the rank holds it: whole, or its tensor-parallel slice
    flat      a ZeRO shard: a contiguous range of a bucket of such tensors laid end to
              end (ops/flat_buckets.py)

Either form is described as `Piece`s: a box (offsets and sizes) of one whole tensor,
and the view of the rank's tensor that holds it. A flat range of a row-major tensor is
a handful of boxes (a partial first row, whole rows, a partial last row, recursively),
each contiguous in memory; a tensor-parallel slice moves a box along its sharded dim,
part by part for a fused weight. A checkpoint stores pieces under their whole tensor's
name, so that another plan reads back whatever boxes it needs
(runtime/checkpoint.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from autopart.ops.flat_buckets import FlatLayout

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


@dataclass(frozen=True, slots=True)
class Piece:
    """A box of the whole tensor `name` (of shape `size`), held by `view`."""

    name: str
    size: tuple[int, ...]
    offsets: tuple[int, ...]
    view: torch.Tensor

    @property
    def region(self) -> tuple[slice, ...]:
        """Where the piece lies in its whole tensor, as an index."""
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.view.shape))


@dataclass(frozen=True, slots=True)
class AxisSlices:
    """How this rank's slices over one mesh axis sit in whole parameters: `layout` maps
    a sharded parameter's name to (dim, parts), as `ops.shards.local_shard` cuts it, over
    `size` ranks (tp's; or ep's, whose expert runs are slices of dim 0 alike)."""

    layout: Mapping[str, tuple[int, int]]
    size: int
    rank: int

    def whole_size(self, name: str, local: Sequence[int]) -> tuple[int, ...]:
        size = list(local)
        if name in self.layout:
            size[self.layout[name][0]] *= self.size
        return tuple(size)

    def place(self, name: str, local: Sequence[int], box: Box, view: torch.Tensor) -> list[Piece]:
        """The pieces of whole `name` that `view`, a box of this rank's slice (of shape
        `local`), holds: one per fused part the box spans."""
        offsets, sizes = box
        whole = self.whole_size(name, local)
        if name not in self.layout:
            return [Piece(name, whole, offsets, view)]
        dim, parts = self.layout[name]
        if local[dim] % parts:
            raise ValueError(f"{name}: dim {dim} of {tuple(local)} is not {parts} equal parts")
        local_part = local[dim] // parts
        start, stop = offsets[dim], offsets[dim] + sizes[dim]
        pieces = []
        for part in range(start // local_part, -(-stop // local_part)):
            lo, hi = max(start, part * local_part), min(stop, (part + 1) * local_part)
            moved = list(offsets)
            # part k of the whole begins at k·local_part·size; this rank's share of it
            # begins rank·local_part further in
            within = lo - part * local_part
            moved[dim] = (part * self.size + self.rank) * local_part + within
            pieces.append(Piece(name, whole, tuple(moved), view.narrow(dim, lo - start, hi - lo)))
        return pieces


@dataclass(frozen=True, slots=True)
class Slices:
    """How this rank's slices sit in whole parameters, cut over several axes: `axes`
    innermost cut first (ep's runs of experts are cut from tp's slices)."""

    axes: tuple[AxisSlices, ...]

    def __contains__(self, name: str) -> bool:
        return any(name in axis.layout for axis in self.axes)

    def whole_size(self, name: str, local: Sequence[int]) -> tuple[int, ...]:
        size = tuple(local)
        for axis in self.axes:
            size = axis.whole_size(name, size)
        return size

    def place(self, name: str, local: Sequence[int], box: Box, view: torch.Tensor) -> list[Piece]:
        """The pieces of whole `name` that `view`, a box of this rank's slice (of shape
        `local`), holds: each axis moves them within the slice the next one cut."""
        pieces = [Piece(name, tuple(local), box[0], view)]
        shape = tuple(local)
        for axis in self.axes:
            pieces = [
                moved
                for p in pieces
                for moved in axis.place(name, shape, (p.offsets, tuple(p.view.shape)), p.view)
            ]
            shape = axis.whole_size(name, shape)
        return pieces


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """The boxes that cover elements [start, stop) of a row-major tensor of `shape`, in
    memory order: each box is contiguous."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,) * len(shape), (stop - start,) * len(shape))]
    row = math.prod(shape[1:])
    first, last = start // row, (stop - 1) // row
    if first == last:
        inner = flat_range_boxes(shape[1:], start - first * row, stop - first * row)
        return [((first, *o), (1, *s)) for o, s in inner]
    boxes: list[Box] = []
    if start % row:  # a partial first row
        boxes += flat_range_boxes(shape, start, (first + 1) * row)
        first += 1
    end = last + 1 if stop % row == 0 else last
    if end > first:  # whole rows
        boxes.append(((first, *[0] * (len(shape) - 1)), (end - first, *shape[1:])))
    if stop % row:  # a partial last row
        boxes += flat_range_boxes(shape, last * row, stop)
    return boxes


def whole_pieces(name: str, tensor: torch.Tensor, tp: Slices) -> list[Piece]:
    """The pieces of a parameter held whole (or as its tensor-parallel slice)."""
    box = ((0,) * tensor.dim(), tuple(tensor.shape))
    return tp.place(name, tuple(tensor.shape), box, tensor)


def flat_pieces(
    flat: torch.Tensor,
    names: Sequence[str],
    layout: FlatLayout,
    rank: int,
    tp: Slices,
) -> list[Piece]:
    """The pieces held by `flat`, rank `rank`'s shard of a bucket of `layout` whose
    tensors are named `names` (padding holds nothing)."""
    lo, hi = layout.shard_slice(rank).start, layout.shard_slice(rank).stop
    pieces = []
    for name, offset, shape in zip(names, layout.offsets, layout.shapes):
        start, stop = max(lo, offset), min(hi, offset + shape.numel())
        position = start - lo
        for box in flat_range_boxes(tuple(shape), start - offset, stop - offset):
            numel = math.prod(box[1])
            view = flat[position : position + numel].view(box[1])
            pieces += tp.place(name, tuple(shape), box, view)
            position += numel
    return pieces


def distinct(pieces: Iterator[Piece] | list[Piece]) -> list[Piece]:
    """`pieces` without repeats of one box (a rank may hold one tensor twice)."""
    seen: set[tuple[str, tuple[int, ...]]] = set()
    out = []
    for piece in pieces:
        key = (piece.name, piece.offsets)
        if key not in seen:
            seen.add(key)
            out.append(piece)
    return out


def assemble(pieces: Iterable[Piece]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each whole tensor the pieces name, rebuilt from them (on the CPU), with a mask of
    the elements some piece covered."""
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for piece in pieces:
        if piece.name not in out:
            whole = torch.zeros(piece.size, dtype=piece.view.dtype)
            out[piece.name] = (whole, torch.zeros(piece.size, dtype=torch.bool))
        whole, covered = out[piece.name]
        whole[piece.region] = piece.view.cpu()
        covered[piece.region] = True
    return out
