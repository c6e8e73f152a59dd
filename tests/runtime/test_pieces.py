"""The geometry of sharded checkpoints: the pieces a rank holds, put back where they
say they lie, rebuild every whole tensor exactly once."""

from __future__ import annotations

import math

import pytest
import torch

from autopart.ops.flat_buckets import FlatLayout
from autopart.ops.shards import local_shard
from autopart.runtime.pieces import (
    AxisSlices,
    Slices,
    distinct,
    flat_pieces,
    flat_range_boxes,
    whole_pieces,
)


def _rebuild(pieces, shapes):
    """Each whole tensor from the pieces, and how often each element was written."""
    out = {name: torch.zeros(shape) for name, shape in shapes.items()}
    hits = {name: torch.zeros(shape) for name, shape in shapes.items()}
    for piece in pieces:
        assert piece.size == tuple(shapes[piece.name])
        out[piece.name][piece.region] = piece.view
        hits[piece.name][piece.region] += 1
    return out, hits


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 6)])
def test_a_flat_range_is_covered_by_contiguous_boxes_in_order(shape):
    numel = math.prod(shape)
    whole = torch.arange(numel).view(shape)
    for start in range(numel):
        for stop in range(start + 1, numel + 1):
            boxes = flat_range_boxes(shape, start, stop)
            got = []
            for offsets, sizes in boxes:
                region = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
                got += whole[region].flatten().tolist()
            assert got == list(range(start, stop)), (start, stop, boxes)
            assert len(boxes) <= 2 * len(shape) - 1


WEIGHTS = {"a": (8, 6), "b": (6,), "fused": (12, 4), "c": (4, 2, 6)}
LAYOUTS = [
    {},
    {"a": (0, 1), "fused": (0, 3), "c": (2, 1)},
    {"a": (1, 1), "b": (0, 1), "fused": (0, 3)},
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("dp", [1, 3, 4])
def test_tensor_parallel_slices_and_flat_shards_rebuild_every_tensor_once(layout, tp, dp):
    torch.manual_seed(0)
    whole = {name: torch.randn(shape) for name, shape in WEIGHTS.items()}
    pieces = []
    for tp_rank in range(tp):
        slices = Slices((AxisSlices(layout, tp, tp_rank),))
        local = {name: _slice(layout, name, t, tp, tp_rank) for name, t in whole.items()}
        if dp == 1:  # held whole (or as the tensor-parallel slice)
            for name, t in local.items():
                pieces += whole_pieces(name, t, slices)
            continue
        names = list(local)
        bucket = FlatLayout.of(list(local.values()), dp)
        for dp_rank in range(dp):
            shard = bucket.shard_of(list(local.values()), dp_rank)
            pieces += flat_pieces(shard, names, bucket, dp_rank, slices)
    # replicas (a parameter tensor parallelism leaves whole) repeat one box; the
    # checkpoint keeps one copy of it, as DCP's global plan does
    rebuilt, hits = _rebuild(distinct(pieces), WEIGHTS)
    for name in WEIGHTS:
        assert torch.equal(hits[name], torch.ones(WEIGHTS[name])), name
        assert torch.equal(rebuilt[name], whole[name]), name


@pytest.mark.parametrize("dp", [1, 3])
def test_experts_cut_over_ep_from_tensor_parallel_slices_rebuild_once(dp):
    """Expert parallelism cuts each rank's run of experts (dim 0) out of the tp slice
    it holds; the two axes' moves compose, a fused weight's parts included."""
    torch.manual_seed(0)
    shapes = {"gate_up": (4, 8, 6), "down": (4, 6, 4), "other": (6, 4)}
    whole = {name: torch.randn(shape) for name, shape in shapes.items()}
    tp_layout = {"gate_up": (1, 2), "down": (2, 1), "other": (0, 1)}
    ep_layout = {"gate_up": (0, 1), "down": (0, 1)}
    ep = tp = 2
    pieces = []
    for ep_rank in range(ep):
        for tp_rank in range(tp):
            slices = Slices(
                (AxisSlices(ep_layout, ep, ep_rank), AxisSlices(tp_layout, tp, tp_rank))
            )
            local = {
                name: _slice(ep_layout, name, _slice(tp_layout, name, t, tp, tp_rank), ep, ep_rank)
                for name, t in whole.items()
            }
            assert slices.whole_size("gate_up", local["gate_up"].shape) == shapes["gate_up"]
            if dp == 1:
                pieces += [p for name, t in local.items() for p in whole_pieces(name, t, slices)]
                continue
            bucket = FlatLayout.of(list(local.values()), dp)
            for dp_rank in range(dp):
                shard = bucket.shard_of(list(local.values()), dp_rank)
                pieces += flat_pieces(shard, list(local), bucket, dp_rank, slices)
    rebuilt, hits = _rebuild(distinct(pieces), shapes)
    for name in shapes:
        assert torch.equal(hits[name], torch.ones(shapes[name])), name
        assert torch.equal(rebuilt[name], whole[name]), name


def _slice(layout, name, t, tp, rank):
    if name not in layout:
        return t
    dim, parts = layout[name]
    return local_shard(t, dim, tp, rank, parts)


def test_a_piece_is_a_view_of_what_the_rank_holds():
    """Loading writes into the pieces' views: they must alias the held tensor."""
    bucket = FlatLayout.of([torch.zeros(4, 3)], 2)
    shard = torch.zeros(bucket.shard_numel)
    slices = Slices((AxisSlices({}, 1, 0),))
    for piece in flat_pieces(shard, ["w"], bucket, 1, slices):
        piece.view.fill_(1.0)
    assert shard.sum().item() == 6.0
