"""Mesh: presets, topology levels, factorization and world-size errors."""

from __future__ import annotations

import json

import pytest

from autopart.degrees import Degrees
from autopart.mesh import Axis, DeviceSpec, Mesh, MeshError, device_spec
from autopart.testing import run_world


def test_presets_carry_public_figures():
    h100 = device_spec("h100-80g")
    assert h100.peak_flops["bf16"] == pytest.approx(989.4e12)
    assert h100.memory_bytes == 80 * 1024**3
    assert device_spec("a100-80g").peak_flops["bf16"] == pytest.approx(312e12)
    assert device_spec("cpu").flops_for("fp32") > 0


def test_cluster_topology_has_a_level_per_network_tier():
    mesh = Mesh.cluster("h100-80g", nodes=4, per_node=8)
    assert mesh.world_size == 32 and not mesh.is_running
    intra, inter = mesh.topology.levels
    assert (intra.size, inter.size) == (8, 4)
    assert intra.bandwidth > inter.bandwidth
    assert mesh.topology.level_of_span(8) == intra
    assert mesh.topology.level_of_span(16) == inter


def test_factorization_must_cover_the_mesh():
    mesh = Mesh.cluster("a100-80g", nodes=2, per_node=8)
    mesh.check_covered(Degrees(dp=4, tp=2, pp=2))
    with pytest.raises(MeshError, match="2×2×1×1×2 = 8 devices, but the mesh .* has 16"):
        mesh.check_covered(Degrees(dp=2, tp=2, pp=2))


def test_planning_mesh_cannot_build_process_groups():
    with pytest.raises(MeshError, match="for planning only"):
        Mesh.cluster("cpu", nodes=1, per_node=2).device_mesh(Degrees(dp=2))


def test_unknown_device_names_the_choices(tmp_path):
    with pytest.raises(MeshError, match="a100-80g"):
        device_spec("tpu-v9")
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(device_spec("cpu").to_json() | {"name": "measured"}))
    assert Mesh.cluster(profile, nodes=1, per_node=2).device.name == "measured"
    assert isinstance(device_spec(profile), DeviceSpec)


def _world_checks():
    local = Mesh.local()
    dm = local.device_mesh(Degrees(dp=2, tp=2))
    names = dm.mesh_dim_names
    wrong = Mesh.cluster("cpu", nodes=1, per_node=8)
    wrong = Mesh(wrong.device, 1, 8, backend="gloo")
    try:
        wrong.device_mesh(Degrees(dp=8))
        error = None
    except MeshError as e:
        error = str(e)
    return local.world_size, local.backend, names, dm.size(names.index(Axis.TP.value)), error


def test_local_mesh_builds_named_device_mesh_and_rejects_another_world_size():
    size, backend, names, tp_size, error = run_world(_world_checks, 4)[0]
    assert (size, backend) == (4, "gloo")
    assert names == ("pp", "dp", "ep", "cp", "tp") and tp_size == 2
    assert "8 devices" in error and "4 processes" in error
