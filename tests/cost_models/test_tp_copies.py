"""The local copies priced beside tensor parallelism's collectives: what `funcol` and
`ops/collectives.py` copy around a gather, a reduce-scatter and a rank's own slice."""

import sympy
import torch
from torch import fx
from torch.distributed.tensor import Replicate, Shard

from autopart.cost_models.comm import ALL_GATHER, LOCAL_COPY, REDUCE_SCATTER, CommModel
from autopart.cost_models.tp_costs import collectives_of
from autopart.mesh import Mesh
from autopart.ops.meta import SHAPE, TensorInfo
from autopart.passes.tp_decision import Decision, Operands

TP = 2


def _conversion(shape: tuple, have, want, grad: bool = True, gather_grad: bool = False):
    """(op, bytes, in backward) of converting a [*shape] fp32 activation from `have` to
    `want` for its consumer."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(torch.relu, (x,))
    SHAPE.set(x, TensorInfo(tuple(sympy.sympify(d) for d in shape), torch.float32))
    SHAPE.set(y, TensorInfo(tuple(sympy.sympify(d) for d in shape), torch.float32))
    ops = Operands(y, [x], [have], [SHAPE.get(x)], [grad], TP)
    decision = Decision(output=want, inputs={0: want}, gather_grad={0} if gather_grad else set())
    return [(c.op, c.nbytes, c.backward) for c in collectives_of(ops, decision, grad)]


def test_a_gather_along_the_sequence_copies_the_whole_and_the_gradient_slice():
    full = 4 * 16 * 8 * 4
    assert _conversion((4, 16, 8), Shard(1), Replicate()) == [
        (ALL_GATHER, full, False),
        (LOCAL_COPY, full, False),
        (LOCAL_COPY, full // TP, True),
    ]


def test_a_gather_along_dim_0_or_after_unit_dims_copies_nothing():
    for shape, dim in (((4, 16, 8), 0), ((1, 16, 8), 1)):
        assert [op for op, *_ in _conversion(shape, Shard(dim), Replicate())] == [ALL_GATHER]


def test_a_symbolic_batch_copies_unless_it_is_one():
    batch = sympy.Symbol("batch", positive=True, integer=True)
    [(_, _, _), (op, nbytes, _), _] = _conversion((batch, 16, 8), Shard(1), Replicate())
    assert op == LOCAL_COPY
    assert nbytes.subs(batch, 1) == 0 and nbytes.subs(batch, 4) == 4 * 16 * 8 * 4


def test_a_scattered_gradient_copies_the_reduce_scatters_input():
    full = 4 * 16 * 8 * 4
    priced = _conversion((4, 16, 8), Shard(1), Replicate(), gather_grad=True)
    assert priced == [
        (ALL_GATHER, full, False),
        (LOCAL_COPY, full, False),
        (REDUCE_SCATTER, full, True),
        (LOCAL_COPY, full, True),
    ]


def test_a_local_copy_costs_its_bytes_read_and_written():
    comm = CommModel(Mesh.cluster("cpu", nodes=1, per_node=2))
    bandwidth = comm.mesh.device.memory_bandwidth
    assert comm.time(LOCAL_COPY, 1e6, TP) == 2e6 / bandwidth
