"""Collective communication over one mesh axis: alpha-beta costs on the topology.

A message of M bytes over a link of latency α and bandwidth B costs α + M/B. An
algorithm takes `steps` sequential steps and sends `volume`·M bytes per rank:

    time = steps · α + volume · M / B

`M` is always the full buffer on one rank: the tensor all-reduced or broadcast, the
gathered output of an all-gather, the input of a reduce-scatter, the send buffer of an
all-to-all, the message of a send/recv.

Algorithms (the cheapest the backends run is taken; `algorithms` prices them all):
    ring                 all-reduce 2(n−1) steps, volume 2(n−1)/n;
                         all-gather, reduce-scatter, all-to-all n−1 steps, (n−1)/n;
                         broadcast (pipelined chain) n−1 steps, volume 1
    recursive doubling   ⌈log2 n⌉ steps; all-reduce volume ⌈log2 n⌉ (the whole buffer
                         each step), all-gather / reduce-scatter (n−1)/n; broadcast
                         (binomial tree) ⌈log2 n⌉ steps of the whole buffer
    halving-doubling     all-reduce as Rabenseifner's butterfly: a reduce-scatter by
                         recursive halving, then an all-gather by recursive doubling,
                         2⌈log2 n⌉ steps, volume 2(n−1)/n (the ring's bytes in
                         logarithmically many steps; a power of two n, else the
                         surplus ranks fold in first: two more steps of the buffer)
    parameter server     all-reduce through one server, one of the ranks: the others
                         send it their buffers and take the sum back, 2 steps, but
                         the server's link carries n−1 buffers each way: volume 2(n−1)
    tree                 all-reduce as NCCL's pipelined double binary tree: a reduce up
                         and a broadcast down, 2⌈log2 n⌉ steps, volume 2 (each rank
                         sends the buffer up and down once); across nodes on as many of
                         a node's NICs as the ring (one tree per channel, each channel
                         on its own NIC)
    hierarchical         axes spanning nodes: reduce-scatter inside each node, the
                         cheapest flat algorithm across nodes on 1/g of the buffer, then
                         all-gather inside the node (all-gather and reduce-scatter keep
                         their one half of this)

Mapping an axis onto the topology. The mesh orders axes pp, dp, tp (tp innermost), so
a step along an axis spans `stride` consecutive ranks (tp: 1, dp: tp, pp: dp·tp). A
group of n ranks with that stride stays inside a node when n·stride divides per_node;
then every step uses the intra-node links (where n·stride is less but does not divide
it, the groups' runs do not tile the nodes, and one straddles two: its steps cross
through one NIC). Otherwise it spans k nodes with g = n/k members in
each. A node's NICs carry per_node × `inter_node_bandwidth`, shared by the per_node/g
groups of the axis that touch the node. NCCL runs a ring per channel, each channel
through another NIC, so a group's rings use all the NICs of its g members: each ring
step moves g × inter_node_bandwidth across a node boundary (at most the intra-node
bandwidth), and every step pays the inter-node latency. A data-parallel group outside
tp = 8 (g = 1) has one NIC of each node, the 7 others serving its 7 sibling groups; a
group of all 8 ranks of each node has all 8. Algorithms whose steps all go
across nodes at once (recursive doubling, the tree, all-to-all, the inter-node phase of the
hierarchical all-reduce) give each device its own share, inter_node_bandwidth.

Overlap with compute. On GPUs a collective runs on the network and copy engines (and a
few SMs under NCCL) while kernels keep computing, so asynchronous collectives can hide
behind compute. Gloo runs collectives on CPU threads of the same processes: with a
rank per core, as autopart's CPU worlds run, every core is computing, and a collective
in flight takes cycles from compute (its copies, reductions and loopback TCP) and waits
on peers that are themselves computing. `CommModel.overlaps_compute` is therefore False
on a running Gloo mesh and on a CPU planned for (`is_cpu`: the `cpu` preset, a profile
calibrated on a CPU), and the plan's communication is priced as serial with compute:
data parallelism's gradient buckets, reduced while backward goes on, add their whole
time to the step, not only the last bucket's.
(Measured on a 2-core host, world 2: ZeRO-3's 12 per-bucket collectives of tiny GPT-2
added about 10 ms to the step, not the 2 ms that would show if they hid behind forward
and backward.) Nor do ZeRO-3's collectives, prefetched and reduced while compute goes
on, cost the sum of what each adds alone: a calibrated CPU profile measures what a
bucket's three add as ZeRO-3 runs them (`zero3_bucket_time`).

Measured costs. A device profile from `autopart calibrate` carries, per collective,
`alpha` (seconds per ring step) and `beta` (seconds per byte a rank sends) fitted on the
local backend. When present they replace the topology for that collective, with the
ring's step and volume counts for the group size. On a CPU the profile times each
collective as a step issues it, between pieces of a layer's compute, so its alpha
holds what a blocking collective costs the world beyond its transfer: the wait for
the latest rank, time-sliced on cores it shares. A tensor-parallel step pays it at
every reduction, a data-parallel one at each gradient bucket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopart.mesh import PRESETS, DeviceSpec, Mesh

ALL_REDUCE = "all_reduce"
ALL_GATHER = "all_gather"
REDUCE_SCATTER = "reduce_scatter"
ALL_TO_ALL = "all_to_all"
BROADCAST = "broadcast"
SEND_RECV = "send_recv"
# A send/recv between ranks that were computing, as a ring attention's step passes the
# keys and values on; a profile may measure it apart from a pipeline's send/recv, whose
# receiver waits for its peer idle.
EXCHANGE = "exchange"
# The local copy a collective's caller makes around it (`CommModel.time` prices it at
# the device's memory bandwidth, read and written): a gather's concatenation along a
# dim other than 0, the reduce-scatter input's along one, the slice a rank keeps of a
# gradient, an all-to-all's stacking and concatenation. `M` is the bytes copied.
LOCAL_COPY = "local_copy"
COLLECTIVES = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, BROADCAST, SEND_RECV)
POINT_TO_POINT = (SEND_RECV, EXCHANGE)


def is_cpu(device: DeviceSpec) -> bool:
    """Whether `device` is a CPU: the `cpu` preset, or a profile `autopart calibrate`
    measured on one, as it records (`calibration["device_type"]`), whatever its name.
    A profile from before that record is told by its default name (`cpu-calibrated`)
    or by the ZeRO-3 buckets only a CPU's measures."""
    measured_on = device.calibration.get("device_type")
    if measured_on is not None:
        return measured_on == "cpu"
    base = PRESETS["cpu"].name
    return device.name in (base, f"{base}-calibrated") or bool(device.zero3_bucket)


def ring_steps(op: str, n: int) -> int:
    """Sequential steps of the ring algorithm for `op` over n ranks."""
    if n == 1:
        return 0
    if op in POINT_TO_POINT:
        return 1
    return 2 * (n - 1) if op == ALL_REDUCE else n - 1


def ring_volume(op: str, n: int) -> float:
    """Bytes one rank sends in the ring algorithm, as a fraction of the buffer:
    2(n−1)/n for all-reduce, (n−1)/n for all-gather, reduce-scatter and all-to-all,
    1 for broadcast (pipelined) and send/recv."""
    if n == 1:
        return 0.0
    if op in (BROADCAST, *POINT_TO_POINT):
        return 1.0
    fraction = (n - 1) / n
    return 2 * fraction if op == ALL_REDUCE else fraction


@dataclass(frozen=True, slots=True)
class Link:
    bandwidth: float  # bytes/s per direction
    latency: float  # seconds per step

    def time(self, steps: float, volume: float, nbytes: float) -> float:
        return steps * self.latency + volume * nbytes / self.bandwidth


@dataclass(frozen=True, slots=True)
class AxisPlacement:
    """Where a group of `size` ranks, `stride` apart, lies: `per_node` members in each
    of `nodes` nodes."""

    size: int
    per_node: int
    nodes: int

    @property
    def spans_nodes(self) -> bool:
        return self.nodes > 1


class CommModel:
    """Alpha-beta times of collectives over the axes of `mesh`."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        d = mesh.device
        self.intra = Link(d.intra_node_bandwidth, d.intra_node_latency)
        self.inter = Link(d.inter_node_bandwidth, d.inter_node_latency)
        # The search asks for the same collectives many times over.
        self._times: dict[tuple[str, float, int, int], float] = {}
        self._sends: dict[tuple[str, float, bool], float] = {}

    @property
    def overlaps_compute(self) -> bool:
        """Whether asynchronous collectives can hide behind compute: not on a running
        Gloo mesh, nor, planned for, on a CPU, whose collectives Gloo would run on the
        cores that compute."""
        if self.mesh.backend is not None:
            return self.mesh.backend != "gloo"
        return not is_cpu(self.mesh.device)

    def placement(self, size: int, stride: int = 1) -> AxisPlacement:
        per_node, run = self.mesh.per_node, size * stride
        if run <= per_node:
            if per_node % run == 0:
                return AxisPlacement(size, size, 1)
            # The groups lie in runs of size·stride consecutive ranks that do not tile a
            # node: a run straddles two nodes, and its group, through one NIC each way,
            # sets the axis's pace.
            return AxisPlacement(size, 1, size)
        members = max(1, min(size, per_node // stride))
        return AxisPlacement(size, members, math.ceil(size / members))

    def send_time(self, nbytes: float, first: int, peer: int, size: int = 1) -> float:
        """Seconds for ranks first … first+size−1 each to send `nbytes` to the rank
        `peer − first` further on, all at once (a pipeline stage to the next): over
        NVLink if every pair shares a node, else over the senders' NICs, one each (the
        slowest pair sets the pace). A measured send/recv replaces the topology."""
        return self._point_to_point(SEND_RECV, nbytes, first, peer, size)

    def exchange_time(self, nbytes: float, first: int, peer: int, size: int = 1) -> float:
        """`send_time` for ranks that were computing and pass `nbytes` on together, a
        ring attention's step: the profile's measured exchange, which holds their
        rendezvous (a CPU's, `autopart calibrate`), else `send_time`."""
        return self._point_to_point(EXCHANGE, nbytes, first, peer, size)

    def crosses_nodes(self, first: int, peer: int, size: int = 1) -> bool:
        """Whether `send_time(..., first, peer, size)` goes between nodes: all it reads
        of where the ranks sit."""
        n = self.mesh.per_node
        return _crosses_nodes(first, peer, min(size, n), n)

    def link_send_time(self, nbytes: float, crosses_nodes: bool) -> float:
        """`send_time` of a pair that goes between nodes or not (`crosses_nodes`)."""
        return self._on_link(SEND_RECV, nbytes, crosses_nodes)

    def _point_to_point(self, op: str, nbytes: float, first: int, peer: int, size: int) -> float:
        if first == peer:
            return 0.0
        return self._on_link(op, nbytes, self.crosses_nodes(first, peer, size))

    def _on_link(self, op: str, nbytes: float, crosses_nodes: bool) -> float:
        if nbytes == 0:
            return 0.0
        key = (op, nbytes, crosses_nodes)
        if key not in self._sends:
            collectives = self.mesh.device.collectives
            measured = collectives.get(op) or collectives.get(SEND_RECV)
            if measured:
                link = Link(1.0 / measured["beta"], measured["alpha"])
            else:
                link = self.inter if key[2] else self.intra
            self._sends[key] = link.time(1, 1.0, nbytes)
        return self._sends[key]

    def time(self, op: str, nbytes: float, size: int, stride: int = 1) -> float:
        """Seconds for collective `op` of an `nbytes` buffer over an axis of `size`
        ranks, `stride` ranks apart: the cheapest algorithm. A `LOCAL_COPY` of
        `nbytes`: their read and write at the device's memory bandwidth."""
        key = (op, nbytes, size, stride)
        if key not in self._times and op == LOCAL_COPY:
            self._times[key] = 2 * nbytes / self.mesh.device.memory_bandwidth
        elif key not in self._times:
            times = self.algorithms(op, nbytes, size, stride)
            self._times[key] = min(t for name, t in times.items() if name not in NOT_RUN)
        return self._times[key]

    @property
    def measures_zero3_buckets(self) -> bool:
        """Whether the profile measured ZeRO-3's collectives run together (a CPU's,
        `autopart calibrate`): `zero3_bucket_time` then prices a bucket."""
        return bool(self.mesh.device.zero3_bucket)

    def zero3_bucket_time(self, nbytes: float, size: int) -> float:
        """Seconds that one ZeRO-3 bucket of `nbytes` over `size` ranks adds to a step
        with its gathers in forward and backward and its reduce-scatter, as the
        profile measured them run together (`DeviceSpec.zero3_bucket`)."""
        measured = self.mesh.device.zero3_bucket
        assert measured, "the profile did not measure ZeRO-3 buckets (measures_zero3_buckets)"
        link = Link(1.0 / measured["beta"], measured["alpha"])
        return link.time(ring_steps(ALL_GATHER, size), ring_volume(ALL_GATHER, size), nbytes)

    def algorithms(self, op: str, nbytes: float, size: int, stride: int = 1) -> dict[str, float]:
        """Seconds for each algorithm that applies."""
        if op not in COLLECTIVES:
            raise ValueError(f"unknown collective {op!r}: use one of {COLLECTIVES}")
        if size == 1 or nbytes == 0:
            return {"none": 0.0}
        measured = self.mesh.device.collectives.get(op)
        if measured:
            link = Link(1.0 / measured["beta"], measured["alpha"])
            return {"measured": link.time(ring_steps(op, size), ring_volume(op, size), nbytes)}
        where = self.placement(size, stride)
        across = self._across(where)
        times = {"ring": self._ring(op, nbytes, where)}
        if op not in (SEND_RECV, ALL_TO_ALL):
            times["recursive_doubling"] = _doubling(op, nbytes, size, across)
        if op == ALL_REDUCE:
            times["halving_doubling"] = _halving_doubling(nbytes, size, across)
            times["parameter_server"] = _parameter_server(nbytes, size, across)
            times["tree"] = _tree(nbytes, size, self._ring_link(where))
        if where.spans_nodes and where.per_node > 1 and op in _HIERARCHICAL:
            times["hierarchical"] = self._hierarchical(op, nbytes, where)
        return times

    # -- algorithms -------------------------------------------------------------------

    def _ring(self, op: str, nbytes: float, where: AxisPlacement) -> float:
        size = where.size
        if op == ALL_TO_ALL and where.spans_nodes:  # pairwise exchange, not a ring
            local = (where.per_node - 1) / size * nbytes / self.intra.bandwidth
            remote = (size - where.per_node) / size * nbytes / self.inter.bandwidth
            return (size - 1) * self.inter.latency + max(local, remote)
        return self._ring_link(where).time(ring_steps(op, size), ring_volume(op, size), nbytes)

    def _ring_link(self, where: AxisPlacement) -> Link:
        if not where.spans_nodes:
            return self.intra
        shared = min(self.intra.bandwidth, where.per_node * self.inter.bandwidth)
        return Link(shared, self.inter.latency)

    def _across(self, where: AxisPlacement) -> Link:
        return self.inter if where.spans_nodes else self.intra

    def _hierarchical(self, op: str, nbytes: float, where: AxisPlacement) -> float:
        g, k = where.per_node, where.nodes
        inside = AxisPlacement(g, g, 1)
        outer = min(
            self.inter.time(ring_steps(op, k), ring_volume(op, k), nbytes / g),
            _doubling(op, nbytes / g, k, self.inter),
            _tree(nbytes / g, k, self.inter) if op == ALL_REDUCE else float("inf"),
        )
        if op == ALL_REDUCE:
            scatter = self._ring(REDUCE_SCATTER, nbytes, inside)
            gather = self._ring(ALL_GATHER, nbytes, inside)
            return scatter + outer + gather
        return self._ring(op, nbytes, inside) + outer


def _crosses_nodes(first: int, peer: int, pairs: int, per_node: int) -> bool:
    """Whether any of ranks first … first+pairs−1 (pairs ≤ per_node) sits in another node
    than the rank `peer − first` further on: the pair whose rank sits furthest along
    its node (towards the end for a later peer, the start for an earlier one) tells."""
    step = peer - first
    if abs(step) >= per_node:
        return True
    start = first % per_node
    wraps = start + pairs > per_node  # the ranks run into the next node
    if step > 0:
        return (per_node - 1 if wraps else start + pairs - 1) + step >= per_node
    return (0 if wraps else start) + step < 0


_HIERARCHICAL = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER)
# Priced, for comparison, but not what a step costs: neither NCCL (ring, trees, in-node
# reductions) nor PyTorch's Gloo (ring) runs them.
NOT_RUN = frozenset({"halving_doubling", "parameter_server"})


def _doubling(op: str, nbytes: float, size: int, link: Link) -> float:
    """Recursive doubling (all-reduce, all-gather, reduce-scatter) or a binomial tree
    (broadcast): ⌈log2 n⌉ steps."""
    steps = math.ceil(math.log2(size))
    if op in (ALL_REDUCE, BROADCAST):
        return link.time(steps, steps, nbytes)
    return link.time(steps, (size - 1) / size, nbytes)


def _halving_doubling(nbytes: float, size: int, link: Link) -> float:
    """Rabenseifner's all-reduce: recursive halving then doubling, 2⌈log2 n⌉ steps and
    2(n−1)/n of the buffer, on the largest power of two of the ranks; the others first
    hand their buffer to a partner and take the sum back (two steps of the buffer)."""
    power = 2 ** int(math.log2(size))
    time = link.time(2 * math.log2(power), 2 * (power - 1) / power, nbytes)
    return time if power == size else time + link.time(2, 2.0, nbytes)


def _parameter_server(nbytes: float, size: int, link: Link) -> float:
    """The server's link carries the n−1 other ranks' buffers up and the sum back
    down: 2 steps, 2(n−1) buffers."""
    return link.time(2, 2.0 * (size - 1), nbytes)


def _tree(nbytes: float, size: int, link: Link) -> float:
    """Pipelined double binary tree all-reduce: 2⌈log2 n⌉ steps, volume 2."""
    return link.time(2 * math.ceil(math.log2(size)), 2.0, nbytes)
