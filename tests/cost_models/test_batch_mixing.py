"""What taking a model's mixing of its batch over the whole batch costs under a split of
it over replicas: a batch × batch product's operands all-gathered forward and
reduce-scattered backward, only the columns' side where the loss reads each replica's
own rows (passes/batch_products.py); a load-balancing loss's
statistics all-reduced both ways, unless taken per part (passes/batch_statistics.py);
nothing where the batch is not split."""

from __future__ import annotations

import pytest
import torch

from autopart.capture import capture
from autopart.cost_models import Choices, predict
from autopart.cost_models.batch_mixing import mixing_sync_comm
from autopart.cost_models.comm import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, CommModel
from autopart.cost_models.summary import BATCH, GraphSummary
from autopart.degrees import Degrees
from autopart.mesh import Mesh
from autopart.passes import analyze
from tests.models import RouterLoss
from tests.zoo_media import TwoTower, image_text_batch

TWO_CPUS = Mesh.cluster("cpu", nodes=1, per_node=2)


def _summary(model: torch.nn.Module, inputs: tuple) -> GraphSummary:
    captured = capture(model, inputs)
    analyze(captured.gm, captured.context())
    return GraphSummary(captured.gm)


def test_a_product_gathers_both_embeddings_forward_and_scatters_their_gradients():
    summary, comm = _summary(TwoTower(dim=8), image_text_batch()[0]), CommModel(TWO_CPUS)
    segments = list(summary.evaluate({BATCH: 4}))
    # Two [4, 8] float32 embeddings a replica, each gathered whole over the 2 replicas.
    assert sum(s.gathered_bytes for s in segments) == 2 * 4 * 8 * 4
    whole = 2 * 4 * 8 * 4 * 2
    want = comm.time(ALL_GATHER, whole, 2) + comm.time(REDUCE_SCATTER, whole, 2)
    assert mixing_sync_comm(segments, Choices(8, Degrees(dp=2)), comm) == pytest.approx(want)
    assert mixing_sync_comm(segments, Choices(8, Degrees(tp=2)), comm) == 0.0
    # A loss over the product's rows: the captions alone, each replica's images its own.
    assert sum(s.rows_bytes for s in segments) == 4 * 8 * 4
    rows = Choices(8, Degrees(dp=2), batch_product_loss="rows")
    half = whole / 2
    want = comm.time(ALL_GATHER, half, 2) + comm.time(REDUCE_SCATTER, half, 2)
    assert mixing_sync_comm(segments, rows, comm) == pytest.approx(want)
    synced = predict(summary, TWO_CPUS, Choices(8, Degrees(dp=2)))
    assert synced.exposed_comm_s > 0.0


def test_a_load_balancing_loss_all_reduces_its_statistics_unless_per_part():
    summary = _summary(RouterLoss(), (torch.randn(2, 6, 8),))
    comm = CommModel(TWO_CPUS)
    segments = list(summary.evaluate({BATCH: 1}))
    # The 4 experts' token counts and router probabilities, in float32.
    statistics = [int(b) for s in segments for b in s.segment.statistics]
    assert statistics == [16, 16]
    each = comm.time(ALL_REDUCE, 16.0, 2)
    global_batch = Choices(2, Degrees(dp=2))
    assert mixing_sync_comm(segments, global_batch, comm) == pytest.approx(4 * each)
    per_part = Choices(2, Degrees(dp=2), per_part_statistics=True)
    assert mixing_sync_comm(segments, per_part, comm) == 0.0
