"""Collectives: the ring's volumes, the axis-to-topology mapping, algorithm choice and
measured costs."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from autopart.cost_models.comm import NOT_RUN, CommModel, is_cpu, ring_steps, ring_volume
from autopart.mesh import PRESETS, DeviceSpec, Mesh

H100 = PRESETS["h100-80g"]
MB = 1e6


def _chosen(times: dict[str, float]) -> str:
    """The algorithm that prices the collective: the cheapest the backends run."""
    return min((name for name in times if name not in NOT_RUN), key=times.__getitem__)


@pytest.mark.parametrize("n", [2, 4, 8, 64])
def test_ring_all_reduce_moves_two_n_minus_one_over_n(n):
    # Patarasuk & Yuan 2009: a bandwidth-optimal all-reduce sends 2(n−1)/n of the buffer.
    assert ring_volume("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    assert ring_steps("all_reduce", n) == 2 * (n - 1)
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert ring_volume(op, n) == pytest.approx((n - 1) / n)


def test_large_all_reduce_inside_a_node_is_bandwidth_bound():
    comm = CommModel(Mesh.cluster(H100, nodes=1, per_node=8))
    nbytes = 1e9
    bandwidth_term = 2 * 7 / 8 * nbytes / H100.intra_node_bandwidth
    times = comm.algorithms("all_reduce", nbytes, 8)
    assert _chosen(times) == "ring"
    assert comm.time("all_reduce", nbytes, 8) == pytest.approx(bandwidth_term, rel=0.03)


def test_small_all_reduce_is_latency_bound_and_avoids_the_ring():
    comm = CommModel(Mesh.cluster(H100, nodes=64, per_node=8))
    times = comm.algorithms("all_reduce", 1024, 64, stride=8)
    assert _chosen(times) != "ring"
    assert comm.time("all_reduce", 1024, 64, stride=8) < times["ring"] / 5


def test_axis_placement_on_the_topology():
    comm = CommModel(Mesh.cluster(H100, nodes=4, per_node=8))
    tp = comm.placement(8, stride=1)  # tp innermost: one node
    dp = comm.placement(4, stride=8)  # dp outside tp=8: one member per node
    mixed = comm.placement(8, stride=2)  # dp outside tp=2: 4 per node, 2 nodes
    assert (tp.per_node, tp.nodes, tp.spans_nodes) == (8, 1, False)
    assert (dp.per_node, dp.nodes) == (1, 4)
    assert (mixed.per_node, mixed.nodes) == (4, 2)


def test_a_group_whose_runs_do_not_tile_the_node_is_priced_across_nodes():
    """tp 3 on nodes of 8: ranks 6, 7 and 8 form a group across two nodes, whose ring
    sets the pace of every tp collective."""
    comm = CommModel(Mesh.cluster(H100, nodes=3, per_node=8))
    straddling = comm.placement(3, stride=1)
    assert straddling.spans_nodes and straddling.per_node == 1
    nbytes = 1e8
    ring = 4 * H100.inter_node_latency + 2 * 2 / 3 * nbytes / H100.inter_node_bandwidth
    assert comm.algorithms("all_reduce", nbytes, 3)["ring"] == pytest.approx(ring, rel=0.01)
    assert comm.time("all_reduce", nbytes, 3) > comm.time("all_reduce", nbytes, 4)


def test_spanning_nodes_shares_the_nics():
    mesh = Mesh.cluster(H100, nodes=2, per_node=8)
    comm = CommModel(mesh)
    nbytes = 1e9
    inside = comm.time("all_gather", nbytes, 8, stride=1)
    across = comm.time("all_gather", nbytes, 2, stride=8)  # one member per node
    # Across nodes each device has its share of the NICs, far below NVLink.
    assert across == pytest.approx(nbytes / 2 / H100.inter_node_bandwidth, rel=0.01)
    assert across > inside


def test_hierarchical_all_reduce_wins_across_nodes():
    comm = CommModel(Mesh.cluster(H100, nodes=8, per_node=8))
    times = comm.algorithms("all_reduce", 256 * MB, 64, stride=1)
    assert "hierarchical" in times
    assert comm.time("all_reduce", 256 * MB, 64) == min(times.values())
    assert times["hierarchical"] < times["ring"]


def test_one_rank_and_empty_messages_cost_nothing():
    comm = CommModel(Mesh.cluster(H100, nodes=1, per_node=8))
    assert comm.time("all_reduce", 1e9, 1) == 0.0
    assert comm.time("broadcast", 0, 8) == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        comm.time("gossip", 1.0, 2)


def test_measured_collectives_replace_the_topology():
    alpha, beta = 1e-4, 1e-9
    device = replace(PRESETS["cpu"], collectives={"all_reduce": {"alpha": alpha, "beta": beta}})
    comm = CommModel(Mesh.cluster(device, nodes=1, per_node=4))
    nbytes = 4e6
    expected = 2 * 3 * alpha + 2 * 3 / 4 * nbytes * beta
    assert comm.time("all_reduce", nbytes, 4) == pytest.approx(expected)
    assert comm.algorithms("all_gather", nbytes, 4).keys() != {"measured"}


def test_a_ring_step_is_priced_as_an_exchange_between_compute_where_measured():
    """Ring attention passes keys and values between ranks that were computing: a
    profile's exchange prices it; a pipeline's transfer keeps the send/recv, and a
    profile without an exchange prices both with it."""
    p2p = {"alpha": 1e-4, "beta": 1e-9}
    exchange = {"alpha": 2e-3, "beta": 2e-9}
    both = replace(PRESETS["cpu"], collectives={"send_recv": p2p, "exchange": exchange})
    comm = CommModel(Mesh.cluster(both, nodes=1, per_node=2))
    assert comm.exchange_time(1e6, 0, 1) == pytest.approx(2e-3 + 2e-3)
    assert comm.send_time(1e6, 0, 1) == pytest.approx(1e-4 + 1e-3)
    older = replace(PRESETS["cpu"], collectives={"send_recv": p2p})
    comm = CommModel(Mesh.cluster(older, nodes=1, per_node=2))
    assert comm.exchange_time(1e6, 0, 1) == comm.send_time(1e6, 0, 1)


def test_gloo_collectives_do_not_hide_behind_compute():
    cpu = PRESETS["cpu"]
    assert not CommModel(Mesh(cpu, 1, 2, backend="gloo")).overlaps_compute
    assert CommModel(Mesh(cpu, 1, 2, backend="nccl")).overlaps_compute
    assert CommModel(Mesh.cluster("h100-80g", 1, 8)).overlaps_compute


def test_collectives_planned_for_a_cpu_do_not_hide_behind_compute():
    # Gloo's threads would take the cores that compute: the cpu preset, and a profile
    # calibrated on a CPU (named after it, or holding ZeRO-3 buckets only a CPU's has).
    cpu = PRESETS["cpu"]
    calibrated = replace(cpu, name="cpu-calibrated")
    renamed = replace(cpu, name="my-host", zero3_bucket={"alpha": 1e-3, "beta": 1e-9})
    for device in (cpu, calibrated, renamed):
        assert is_cpu(device)
        assert not CommModel(Mesh.cluster(device, 1, 2)).overlaps_compute
    for name in ("a100-80g", "h100-80g", "h200", "a10-24g"):
        assert not is_cpu(PRESETS[name])
        assert CommModel(Mesh.cluster(name, 1, 8)).overlaps_compute


def test_a_profile_is_a_cpu_as_its_calibration_recorded_whatever_its_name():
    cpu = PRESETS["cpu"]
    one_process = replace(cpu, name="my-host", calibration={"device_type": "cpu"})
    assert is_cpu(one_process)  # no ZeRO-3 buckets measured at world 1
    assert not CommModel(Mesh.cluster(one_process, 1, 2)).overlaps_compute
    gpu = replace(cpu, name="cpu-calibrated", calibration={"device_type": "cuda"})
    assert not is_cpu(gpu)
    assert CommModel(Mesh.cluster(gpu, 1, 8)).overlaps_compute


def test_rings_across_nodes_use_every_nic_of_their_members():
    # 4 nodes of 8 A100s, one 200 Gb/s NIC per GPU (25 GB/s): a group of all 32 ranks
    # has 8 members in each node and rings over all 8 NICs (200 GB/s, NVLink's 300 GB/s
    # not binding); a group with 2 members a node (stride 4) has 2 NICs; with one member
    # a node (stride 8, dp outside tp = 8), one.
    nbytes = 1e9

    def ring_bandwidth(device: DeviceSpec, size: int, stride: int = 1) -> float:
        comm = CommModel(Mesh.cluster(device, nodes=4, per_node=8))
        ring = comm.algorithms("all_gather", nbytes, size, stride)["ring"]
        latency = (size - 1) * device.inter_node_latency
        return (size - 1) / size * nbytes / (ring - latency)

    a100 = PRESETS["a100-80g"]
    nic = a100.inter_node_bandwidth
    assert ring_bandwidth(a100, 32) == pytest.approx(8 * nic)
    assert ring_bandwidth(a100, 8, stride=4) == pytest.approx(2 * nic)
    assert ring_bandwidth(a100, 4, stride=8) == pytest.approx(nic)
    # An H100 node's 8 NDR NICs carry 400 GB/s, under its NVLink's 450; with a slower
    # NVLink the ring runs at NVLink's pace.
    assert ring_bandwidth(H100, 32) == pytest.approx(8 * H100.inter_node_bandwidth)
    slow_nvlink = replace(H100, intra_node_bandwidth=200e9)
    assert ring_bandwidth(slow_nvlink, 32) == pytest.approx(200e9)


def test_latency_bound_all_reduce_at_thousands_of_ranks_takes_a_tree():
    # 2048 data-parallel ranks, one per node: a 1 MiB bucket pays 2 × 2047 ring steps of
    # inter-node latency (61 ms) but 2 × 11 tree steps.
    comm = CommModel(Mesh.cluster("a100-80g", nodes=2048, per_node=8))
    times = comm.algorithms("all_reduce", 2**20, 2048, stride=8)
    assert _chosen(times) == "tree"
    assert times["ring"] > 50 * times["tree"]


# Textbook all-reduce costs (Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009)
# for P ranks, latency L per step and bandwidth B, of an M-byte buffer.
L, B, M = 5e-6, 100e9, 64 * MB


def _flat(ranks: int) -> CommModel:
    """P ranks in one node, every link alike."""
    device = replace(H100, intra_node_bandwidth=B, intra_node_latency=L)
    return CommModel(Mesh.cluster(device, nodes=1, per_node=ranks))


@pytest.mark.parametrize("p", [2, 4, 8, 64])
def test_all_reduce_algorithms_cost_their_textbook_formulas(p):
    log_p = math.log2(p)
    times = _flat(p).algorithms("all_reduce", M, p)
    assert times["ring"] == pytest.approx(2 * (p - 1) * L + 2 * (p - 1) / p * M / B)
    assert times["recursive_doubling"] == pytest.approx(log_p * L + log_p * M / B)
    assert times["halving_doubling"] == pytest.approx(2 * log_p * L + 2 * (p - 1) / p * M / B)
    assert times["tree"] == pytest.approx(2 * log_p * L + 2 * M / B)  # pipelined: 2M, not 2M log P
    assert times["parameter_server"] == pytest.approx(2 * L + 2 * (p - 1) * M / B)


def test_halving_doubling_folds_in_the_ranks_beyond_a_power_of_two():
    p, power = 6, 4
    halving = _flat(p).algorithms("all_reduce", M, p)["halving_doubling"]
    folded = 2 * L + 2 * M / B  # hand the buffer over, take the sum back
    assert halving == pytest.approx(2 * 2 * L + 2 * (power - 1) / power * M / B + folded)


def test_hierarchical_all_reduce_crosses_the_slow_links_once():
    """k nodes of g ranks: reduce-scatter inside the node, all-reduce of M/g across
    nodes (a ring for a large buffer), all-gather inside the node."""
    k, g = 4, 8
    inter_b, inter_l = 25e9, 20e-6
    device = replace(
        H100,
        intra_node_bandwidth=B,
        intra_node_latency=L,
        inter_node_bandwidth=inter_b,
        inter_node_latency=inter_l,
    )
    comm = CommModel(Mesh.cluster(device, nodes=k, per_node=g))
    inside = 2 * ((g - 1) * L + (g - 1) / g * M / B)
    across = 2 * (k - 1) * inter_l + 2 * (k - 1) / k * (M / g) / inter_b
    assert comm.algorithms("all_reduce", M, k * g)["hierarchical"] == pytest.approx(inside + across)


def test_the_cheapest_algorithm_the_backends_run_prices_a_step():
    """Small buffers are latency-bound: recursive doubling's log P steps beat the
    ring's 2(P−1); large ones bandwidth-bound: the ring's 2(P−1)/P·M beats the tree's
    2M. Halving-doubling and the parameter server are priced but run by neither NCCL
    nor PyTorch's Gloo, so they never set the price."""
    small = _flat(64).algorithms("all_reduce", 1024, 64)
    assert _flat(64).time("all_reduce", 1024, 64) == small["recursive_doubling"] < small["ring"]
    large = _flat(8).algorithms("all_reduce", M, 8)
    assert _flat(8).time("all_reduce", M, 8) == large["ring"] < large["tree"]
    assert large["halving_doubling"] < large["ring"]  # cheaper on paper, but not run


def test_a_send_crosses_nodes_where_any_of_its_pairs_does():
    """`_crosses_nodes` against every pair of ranks sending together, one by one."""
    from autopart.cost_models.comm import _crosses_nodes

    for n in (1, 2, 4, 8):
        for first in range(3 * n):
            for peer in range(3 * n):
                for pairs in range(1, n + 1):
                    each = any((first + i) // n != (peer + i) // n for i in range(pairs))
                    assert _crosses_nodes(first, peer, pairs, n) == each, (first, peer, pairs)
