"""The loss after the graph: a recognized cross-entropy is priced on the last segment,
over the logits as each plan leaves them."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Shard

from autopart.api import captured_for_planning
from autopart.batch import BATCH
from autopart.cost_models.summary import GraphSummary, TpLayout
from autopart.ops.loss_match import match_cross_entropy
from tests.models import lm_loss, tiny_llama, token_batch

BATCH_SIZE, SEQ = 8, 16
DIMS = {BATCH: BATCH_SIZE, "seq": SEQ}


@pytest.fixture(scope="module")
def captured():
    ids, _ = token_batch(BATCH_SIZE, SEQ)
    return captured_for_planning(tiny_llama(layers=2), (ids,))


@pytest.fixture(scope="module")
def logits_leaf(captured) -> int:
    loss = match_cross_entropy(lm_loss, captured.gm)
    assert loss is not None
    return loss.logits


def _vocab(captured) -> int:
    return captured.gm.get_parameter("lm_head.weight").shape[0]


def test_the_last_segment_carries_the_loss_over_the_logits(captured, logits_leaf):
    plain = GraphSummary(captured.gm).evaluate(DIMS)
    priced = GraphSummary(captured.gm, loss_logits=logits_leaf).evaluate(DIMS)
    assert [len(s.nodes) for s in priced[:-1]] == [len(s.nodes) for s in plain[:-1]]
    assert len(priced[-1].nodes) == len(plain[-1].nodes) + 1
    loss = priced[-1].nodes[-1]
    logits = BATCH_SIZE * SEQ * _vocab(captured)
    assert loss.flops == logits and loss.evaluations == logits
    assert loss.written_bytes == logits * 4 + 4 and loss.saved_bytes == 0


def test_the_loss_is_split_only_where_the_logits_stay_sharded(captured, logits_leaf):
    gm = captured.gm
    vocab = {"lm_head.weight": Shard(0)}
    sharded = TpLayout.of(gm, vocab, 2, sharded_logits=logits_leaf)
    assert sharded.vocab_parallel_loss
    gathered = TpLayout.of(gm, vocab, 2)  # no loss recognized: the logits are gathered
    assert not gathered.vocab_parallel_loss
    whole = GraphSummary(gm, loss_logits=logits_leaf).evaluate(DIMS)[-1].nodes[-1].flops
    for layout, share in ((sharded, whole / 2), (gathered, whole)):
        summary = GraphSummary(gm, layout, loss_logits=logits_leaf)
        assert summary.sharded(DIMS, 2)[-1].nodes[-1].flops == share


def test_under_cp_the_loss_reads_the_gathered_logits(captured, logits_leaf):
    summary = GraphSummary(captured.gm, loss_logits=logits_leaf)
    whole = summary.evaluate(DIMS)[-1].nodes[-1]
    on_a_rank = summary.context_parallel(DIMS, 1, 2)[-1].nodes[-1]
    assert on_a_rank.flops == whole.flops
