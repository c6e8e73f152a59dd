"""A graph summary's segments: the copies of a block share their operators' work, and the
sums the search reads of it (`Totals`), which stay with the operators they sum."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autopart.api import captured_for_planning
from autopart.batch import BATCH
from autopart.cost_models.summary import GraphSummary
from tests.models import tiny_llama, token_batch

BATCH_SIZE, SEQ = 8, 16


@pytest.fixture(scope="module")
def summary() -> GraphSummary:
    ids, _ = token_batch(BATCH_SIZE, SEQ)
    return GraphSummary(captured_for_planning(tiny_llama(layers=3), (ids,)).gm)


def test_a_blocks_copies_share_one_tp_share_and_its_sums(summary):
    dims = {BATCH: BATCH_SIZE, "seq": SEQ}
    whole = [s for s in summary.evaluate(dims) if s.is_block]
    shares = [s for s in summary.sharded(dims, 2) if s.is_block]
    assert len(shares) == 3 and len({s.key for s in shares}) == 3
    assert all(s.nodes is shares[0].nodes and s.totals is shares[0].totals for s in shares)
    assert shares[0].flops < whole[0].flops  # tp's share of each block


def test_replaced_operators_are_summed_again(summary):
    block = next(s for s in summary.evaluate({BATCH: BATCH_SIZE, "seq": SEQ}) if s.is_block)
    halved = replace(block, nodes=tuple(w.scaled(0.5) for w in block.nodes))
    assert halved.totals is not block.totals
    assert halved.flops == pytest.approx(block.flops / 2)
    assert halved.saved_bytes("bf16-mixed") == pytest.approx(block.saved_bytes("bf16-mixed") / 2)


def test_work_kept_across_sizes_and_summaries_is_what_a_fresh_summary_makes(summary):
    # The operators' work is kept by the sizes each reads (`_NodeWorks`), for every
    # summary of the graph: asked after other sizes, and by another summary, it must
    # come out as a summary that never saw them makes it.
    sizes = [{BATCH: b, "seq": s} for b, s in ((4, SEQ), (2, SEQ // 2), (0.5, SEQ), (1, SEQ))]
    for dims in sizes:
        summary.evaluate(dims)
    sharing = GraphSummary(summary.gm, like=summary)
    for dims in sizes:
        fresh = GraphSummary(summary.gm).evaluate(dims)
        for kept in (summary.evaluate(dims), sharing.evaluate(dims)):
            assert [s.nodes for s in kept] == [s.nodes for s in fresh]
