"""Degrees: the one type that knows the mesh axes. Its arithmetic, its errors, and the
promise that an axis added to it alone is enumerated by planning, pinned by name and
carried by plans and their JSON."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from autopart import degrees as degrees_module
from autopart.capture import capture
from autopart.degrees import Axis, Degrees, MeshError
from autopart.mesh import Mesh
from autopart.ops.groups import MeshGroups
from autopart.passes import analyze
from autopart.plan import Plan
from autopart.solver import Pins, make_plan
from autopart.solver.search import _choices
from autopart.solver.tp_layouts import TpLayouts
from tests.models import tiny_gpt2, token_batch


def test_degrees_know_their_product_strides_and_axes_in_use():
    d = Degrees(dp=4, tp=2, pp=2)
    assert (d[Axis.DP], d["tp"], d[Axis.PP]) == (4, 2, 2)
    assert d.world_size == 16
    # Mesh order pp, dp, tp: tp neighbours are adjacent ranks, pp ones dp·tp apart.
    assert [d.stride(a) for a in (Axis.TP, Axis.DP, Axis.PP)] == [1, 2, 8]
    assert Degrees(dp=8).enabled == (Axis.DP,)
    assert d.replace(dp=2) == Degrees(dp=2, tp=2, pp=2)
    assert Degrees.from_json(d.to_json()) == d
    d.check_covers(16, "2×8 h100")
    with pytest.raises(
        MeshError, match="pp×dp×ep×cp×tp = 2×4×1×1×2 = 16 devices, but the mesh m has 8"
    ):
        d.check_covers(8, "m")


def test_bad_degrees_say_what_is_wrong():
    with pytest.raises(MeshError, match="unknown mesh axes \\['xp'\\]"):
        Degrees(xp=2)
    with pytest.raises(MeshError, match="degree of dp must be a positive integer, not '2'"):
        Degrees(dp="2")
    with pytest.raises(MeshError, match="not 0"):
        Degrees(tp=0)


def test_factorizations_cover_the_world_and_keep_pins():
    every = list(Degrees.factorizations(8))
    assert len(every) == len(set(every)) == 35  # ordered 5-tuples with product 8
    assert all(d.world_size == 8 for d in every)
    pinned = list(Degrees.factorizations(8, {Axis.TP: 2}))
    assert {d[Axis.TP] for d in pinned} == {2} and len(pinned) == 10
    assert list(Degrees.factorizations(8, {"tp": 3})) == []


def test_an_axis_added_to_degrees_alone_is_planned(monkeypatch):
    """A dummy axis, declared in `MESH_AXES` only: the search enumerates it at every
    degree, pins and plans take it by name, and plan files carry it."""
    axes = (Axis.PP, Axis.DP, Axis.EP, "xp", Axis.CP, Axis.TP)
    monkeypatch.setattr(degrees_module, "MESH_AXES", axes)
    ids, _ = token_batch(8)
    captured = capture(tiny_gpt2(), (ids,))
    analyze(captured.gm, captured.context())
    mesh = Mesh.cluster("cpu", nodes=1, per_node=8)
    blocks = ("transformer.h.0", "transformer.h.1")
    dims = {k: v for k, v in captured.dim_sizes.items() if k != "batch"}
    layouts = TpLayouts(captured.gm, captured.parameter_names, mesh, dims)
    seen = {c.degrees["xp"] for c in _choices(layouts, mesh, Pins.of(), 8, blocks)}
    assert seen == {1, 2, 4, 8}
    plan = make_plan(captured, mesh, Pins.of(xp=2, tp=1, pp=1))
    assert (plan.xp, plan.dp, plan.tp, plan.pp) == (2, 4, 1, 1)
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.to_json()["xp"] == 2 and "xp=2" in str(plan)
    assert plan.with_changes(xp=1, dp=8).degrees == Degrees(dp=8)


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    yield
    dist.destroy_process_group()


def test_a_combined_group_spans_two_axes(fake_world):
    groups = MeshGroups(Degrees(dp=2, tp=2, pp=2).device_mesh("cpu"))
    assert [groups.size(a) for a in (Axis.PP, Axis.DP, Axis.TP)] == [2, 2, 2]
    # Rank 5 is (pp 1, dp 0, tp 1): its dp×tp group is the second half of the world.
    assert [groups.rank(a) for a in (Axis.PP, Axis.DP, Axis.TP)] == [1, 0, 1]
    assert dist.get_process_group_ranks(groups.group(Axis.DP, Axis.TP)) == [4, 5, 6, 7]
    assert dist.get_process_group_ranks(groups.group(Axis.DP)) == [5, 7]
