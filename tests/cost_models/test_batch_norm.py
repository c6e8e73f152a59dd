"""What batch norms cost under a split of the batch over replicas (passes/batch_norm.py):
over the global batch, one all-reduce of per-channel sums per norm in forward and one in
backward; with per-part statistics, one broadcast of the first replica's running
statistics per norm in forward; nothing where the batch is not split."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopart.capture import capture
from autopart.cost_models import Choices, predict
from autopart.cost_models.batch_norm import norm_sync_comm
from autopart.cost_models.comm import ALL_REDUCE, BROADCAST, CommModel
from autopart.cost_models.summary import BATCH, GraphSummary
from autopart.degrees import Degrees
from autopart.mesh import Mesh
from autopart.passes import analyze

TWO_CPUS = Mesh.cluster("cpu", nodes=1, per_node=2)
CHANNELS = (4, 6)


def _summary() -> GraphSummary:
    model = nn.Sequential(
        nn.Conv2d(3, CHANNELS[0], 3, padding=1),
        nn.BatchNorm2d(CHANNELS[0]),
        nn.Conv2d(CHANNELS[0], CHANNELS[1], 3, padding=1),
        nn.BatchNorm2d(CHANNELS[1]),
        nn.Flatten(),
    )
    captured = capture(model, (torch.randn(8, 3, 4, 4),))
    analyze(captured.gm, captured.context())
    return GraphSummary(captured.gm)


def test_each_batch_norm_all_reduces_its_sums_forward_and_backward():
    summary, comm = _summary(), CommModel(TWO_CPUS)
    segments = list(summary.evaluate({BATCH: 4}))
    assert sorted(c for s in segments for c in s.segment.norm_channels) == list(CHANNELS)
    global_batch = Choices(8, Degrees(dp=2))
    # float64 sums: count, Σx, Σx² forward; Σg, Σ(g·x̂) backward
    want = sum(
        comm.time(ALL_REDUCE, 8 * (2 * c + 1), 2) + comm.time(ALL_REDUCE, 8 * 2 * c, 2)
        for c in CHANNELS
    )
    assert norm_sync_comm(segments, global_batch, comm) == pytest.approx(want)
    per_part = Choices(8, Degrees(dp=2), per_part_statistics=True)
    broadcasts = sum(comm.time(BROADCAST, 4 * 2 * c, 2) for c in CHANNELS)
    assert norm_sync_comm(segments, per_part, comm) == pytest.approx(broadcasts)
    assert norm_sync_comm(segments, Choices(8, Degrees(tp=2)), comm) == 0.0


def test_the_step_is_priced_with_them():
    summary = _summary()
    synced = predict(summary, TWO_CPUS, Choices(8, Degrees(dp=2)))
    per_part = predict(summary, TWO_CPUS, Choices(8, Degrees(dp=2), per_part_statistics=True))
    assert synced.exposed_comm_s > per_part.exposed_comm_s
