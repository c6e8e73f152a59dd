"""What context parallelism costs follows what its rewrite runs (`cost_models/cp_layout.py`):
an operator on the sequence's shards is priced on a rank's 1/cp of the tokens, one the
rewrite runs on the whole sequence (a routed expert layer, attention the ring does not
take) on all of them, on every cp rank, with the gathers it needs on the cp links.
Same batch per rank at cp=1 and cp=2 (cp splits sequences, not the batch)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import fx, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from autopart.api import captured_for_planning
from autopart.capture import capture
from autopart.cost_models import cp_layout
from autopart.cost_models.choices import Choices, CostModels
from autopart.cost_models.comm import ALL_GATHER, LOCAL_COPY
from autopart.cost_models.context import conversion_comm, ring_comm, ring_floor
from autopart.cost_models.predict import rank_segments
from autopart.cost_models.summary import BATCH, GraphSummary, SegmentWork
from autopart.cost_models.work import ATTENTION, NodeWork
from autopart.degrees import Degrees
from autopart.mesh import Mesh
from autopart.ops.aten import ATTENTION_OPS, GROUPED_MM_OPS, op_name
from autopart.ops.context_parallel import ring_attention
from autopart.ops.groups import MeshGroups
from autopart.ops.meta import COLLECTIVE, MODULE_PATH
from autopart.ops.params import parameter_names
from autopart.passes import analyze
from autopart.passes.rewrite import rank_program
from autopart.passes.runner import RankTarget
from autopart.passes.tp_decision import DegreeReads, Operands
from autopart.passes.tp_propagate import gradient_flow
from autopart.solver import Pins, make_plan
from tests.models import tiny_llama, tiny_mixtral, token_batch

BATCH_SIZE, SEQ = 4, 16
MESHES = {cp: Mesh.cluster("h100-80g", nodes=1, per_node=cp) for cp in (1, 2)}


class OneAttentionLayer(nn.Module):
    """Embeddings, one attention layer with a residual, a head. `masked`: the attention
    masks padding (token 0), a mask computed from the tokens' values."""

    def __init__(self, masked: bool, width: int = 32, heads: int = 4, vocab: int = 64) -> None:
        super().__init__()
        self.masked, self.heads = masked, heads
        self.embed = nn.Embedding(vocab, width)
        self.qkv = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
        self.out = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.heads, -1).transpose(1, 2) for p in self.qkv)
        mask = (ids != 0)[:, None, None, :] if self.masked else None
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.head(x + self.out(attended.transpose(1, 2).reshape(b, s, -1)))


def _summary(model: nn.Module) -> GraphSummary:
    ids, _ = token_batch(BATCH_SIZE, SEQ)
    return GraphSummary(captured_for_planning(model, (ids,)).gm)


def _segments(summary: GraphSummary, cp: int) -> tuple[SegmentWork, ...]:
    choices = Choices(BATCH_SIZE, Degrees(cp=cp))
    return rank_segments(summary, {BATCH: BATCH_SIZE, "seq": SEQ}, choices)


def _works(summary: GraphSummary, cp: int) -> dict[fx.Node, NodeWork]:
    """Each operator's work on one rank of cp."""
    return {
        node: work
        for seg in _segments(summary, cp)
        for node, work in zip(seg.segment.nodes, seg.nodes)
    }


def test_a_routed_layer_runs_whole_on_every_cp_rank():
    """The cp rewrite gathers the sequence before a mixture-of-experts layer's router
    (it flattens [batch, seq] into rows) and splits it again at the residual add: every
    cp rank computes every expert's rows of all its sequences' tokens, as at cp=1, and
    saves as much for backward."""
    summary = _summary(tiny_mixtral())
    one, two = _works(summary, 1), _works(summary, 2)
    routed = [n for n in one if op_name(n, summary.gm) in GROUPED_MM_OPS]
    assert len(routed) == 4  # two layers, each its gate/up and its down multiply
    for node in routed:
        assert two[node].cp_whole and not one[node].cp_whole
        assert two[node].flops == one[node].flops > 0
        assert two[node].saved_bytes == one[node].saved_bytes > 0
    models = CostModels.of(MESHES[2], "fp32")
    routed_time = [sum(models.compute.time(w[n]).total for n in routed) for w in (one, two)]
    assert routed_time[1] == pytest.approx(routed_time[0])
    # The attention's projections act on each token alone: half the tokens, half the work.
    projections = [n for n in one if "self_attn" in MODULE_PATH.get(n) and op_name(n) == "linear"]
    assert projections
    for node in projections:
        assert two[node].flops == pytest.approx(one[node].flops / 2)


def test_a_dense_mlp_halves_under_cp():
    summary = _summary(tiny_llama())
    one, two = _works(summary, 1), _works(summary, 2)
    mlp = [n for n in one if ".mlp." in MODULE_PATH.get(n) and op_name(n) == "linear"]
    assert len(mlp) == 6
    for node in mlp:
        assert not two[node].cp_whole
        assert two[node].flops == pytest.approx(one[node].flops / 2)
        assert two[node].saved_bytes == pytest.approx(one[node].saved_bytes / 2)


def test_a_share_below_one_sequence_is_priced_as_that_fraction():
    """A microbatch of one sequence over 2 cp ranks: each rank's dense layers take half
    its tokens, half the work (the captured batch is symbolic: not rounded to none)."""
    summary = _summary(tiny_llama())
    assert summary.captured_batch is None
    at = {BATCH: 1, "seq": SEQ}
    one, two = (rank_segments(summary, at, Choices(1, Degrees(cp=cp))) for cp in (1, 2))
    mlp = [
        (w1, w2)
        for s1, s2 in zip(one, two)
        for n, w1, w2 in zip(s1.segment.nodes, s1.nodes, s2.nodes)
        if ".mlp." in MODULE_PATH.get(n) and op_name(n) == "linear"
    ]
    assert len(mlp) == 6
    for whole, half in mlp:
        assert half.flops == pytest.approx(whole.flops / 2) and whole.flops > 0


def test_a_routed_layer_gathers_the_sequence_over_cp():
    """Per layer: the router's input all-gathered in forward; the layer's output split
    again at the residual add, its gradient all-gathered in backward. Activations
    captured in fp32, [batch, seq, hidden 64]. Each gather along the sequence copies
    what arrives twice (joined along dim 1, then its chunks put in order), and each
    rank's slice joins its two chunks: the local copies beside the collectives."""
    hidden = BATCH_SIZE * SEQ * 64 * 4
    blocks = [s for s in _segments(_summary(tiny_mixtral()), 2) if s.is_block]
    assert len(blocks) == 2
    for seg in blocks:
        assert sorted(t for t in seg.cp_traffic if t[0] != LOCAL_COPY) == [
            (ALL_GATHER, hidden, False, 0.5, 1),
            (ALL_GATHER, hidden, True, 0.5, 1),
        ]
        copies = {t[1:3] for t in seg.cp_traffic if t[0] == LOCAL_COPY}
        assert {(2 * hidden, False), (2 * hidden, True), (hidden / 2, False)} <= copies
        assert (hidden / 2, True) in copies
    comm = CostModels.of(MESHES[2], "fp32").comm
    assert conversion_comm(blocks, 2, 1, "fp32", [False, False], comm) > 0.0


def test_masked_attention_is_priced_as_gathered_not_as_a_ring():
    """A mask the ring does not take (read from the tokens): the rewrite gathers q, k, v
    and the mask and runs the attention whole, and the projection after it up to the
    residual add, whose gradient it gathers again. Unmasked, the same attention rings."""
    models = CostModels.of(MESHES[2], "fp32")
    masked, plain = _summary(OneAttentionLayer(masked=True)), _summary(OneAttentionLayer(False))
    attention = {}
    for name, summary in (("masked", masked), ("plain", plain)):
        one, two = _works(summary, 1), _works(summary, 2)
        [node] = [n for n in one if op_name(n, summary.gm) in ATTENTION_OPS]
        attention[name] = (one[node], two[node])
    whole, split = attention["masked"][1], attention["plain"][1]
    assert whole.cp_whole and whole.flops == attention["masked"][0].flops
    assert whole.saved_bytes == attention["masked"][0].saved_bytes
    assert not split.cp_whole and split.flops == pytest.approx(attention["plain"][0].flops / 2)

    def comm(summary: GraphSummary) -> tuple[float, float, list]:
        segments = _segments(summary, 2)
        again = [False] * len(segments)
        rings = ring_comm(segments, 2, 1, "fp32", again, models.comm, models.compute)
        gathers = conversion_comm(segments, 2, 1, "fp32", again, models.comm)
        traffic = sorted(
            (op, b, back)
            for s in segments
            for op, b, back, _, n in s.cp_traffic
            if op != LOCAL_COPY
        )
        return rings, gathers, traffic

    rings, gathers, traffic = comm(masked)
    activation = BATCH_SIZE * SEQ * 32 * 4  # q, k, v, the projection: fp32 [b, s, 32]
    padding = BATCH_SIZE * SEQ  # the mask: bool [b, 1, 1, s]
    assert rings == 0.0 and gathers > 0.0
    assert traffic == sorted(
        [(ALL_GATHER, activation, False)] * 3
        + [(ALL_GATHER, padding, False), (ALL_GATHER, activation, True)]
    )
    rings, gathers, traffic = comm(plain)
    assert rings > 0.0 and gathers == 0.0 and traffic == []


@pytest.mark.parametrize("masked", [False, True], ids=["ring", "gathered"])
def test_the_ring_floor_is_under_what_the_layout_adds(masked):
    """Without a cp layout, the search's floor charges each attention the lesser of its
    ring and its whole sequence's compute over the rank's share (`ring_floor`): above 0,
    and never above what pricing by the layout adds to every operator on 1/cp of the
    tokens, whether the attention rings or is gathered and runs whole. One device a
    node, on slow links."""
    summary = _summary(OneAttentionLayer(masked))
    models = CostModels.of(Mesh.cluster("a10-24g", nodes=2, per_node=1), "fp32")
    at = {BATCH: BATCH_SIZE, "seq": SEQ}
    local = summary.sharded({**at, BATCH: BATCH_SIZE / 2}, 1)
    whole = summary.sharded(at, 1)
    laid_out = _segments(summary, 2)
    again = [False] * len(local)
    floor = ring_floor(local, whole, 2, 1, "fp32", again, models.comm, models.compute)

    def compute(segments) -> float:
        return sum(models.compute.cost(s.nodes).total for s in segments)

    added = (
        compute(laid_out)
        - compute(local)
        + ring_comm(laid_out, 2, 1, "fp32", again, models.comm, models.compute)
        + conversion_comm(laid_out, 2, 1, "fp32", again, models.comm)
    )
    assert 0 < floor <= added


def test_a_causal_mask_built_from_shapes_is_priced_as_a_ring():
    """A traced Hugging Face decoder hands attention a causal mask built from aranges,
    which the rewrite turns back into `is_causal=True` (`passes/causal_attention.py`):
    its attention runs as a ring, and only what reads the whole sequence's shape
    (positions, rotary tables) is whole."""
    summary = _summary(tiny_llama())
    segments = _segments(summary, 2)
    attention = [w for s in segments for w in s.nodes if w.kind == ATTENTION]
    assert len(attention) == 2 and not any(w.cp_whole for w in attention)
    # no collective: the whole tables' own slices copy locally
    assert all(op == LOCAL_COPY for s in segments for op, *_ in s.cp_traffic)
    models = CostModels.of(MESHES[2], "fp32")
    again = [False] * len(segments)
    assert ring_comm(segments, 2, 1, "fp32", again, models.comm, models.compute) > 0.0


def test_a_rank_of_cp_keeps_every_routed_layer_whole():
    """At the same sequences per rank, cp=2 leaves every routed layer's work as it is
    at cp=1 and halves the rest (but what reads the whole sequence's shape): a rank's
    work falls by less than half."""
    summary = _summary(tiny_mixtral())
    segments = {cp: _segments(summary, cp) for cp in (1, 2)}
    flops = {cp: sum(s.flops for s in segments[cp]) for cp in (1, 2)}
    routed = sum(
        w.flops
        for s in segments[1]
        for n, w in zip(s.segment.nodes, s.nodes)
        if op_name(n, summary.gm) in GROUPED_MM_OPS
    )
    assert routed > flops[1] / 2
    assert flops[2] == pytest.approx((flops[1] - routed) / 2 + routed, rel=0.01)


@pytest.fixture(scope="module")
def cp_groups():
    """A "fake" world of 2 as the cp axis: the rewrite needs only the group's name, this
    rank's place and the size; nothing is communicated."""
    if dist.is_initialized():
        pytest.skip("needs a process group of its own")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    names = ("pp", "dp", "ep", "cp", "tp")
    yield MeshGroups(init_device_mesh("cpu", (1, 1, 1, 2, 1), mesh_dim_names=names))
    dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:autopart. context parallelism gathers the sequence")
@pytest.mark.parametrize(
    "build",
    [tiny_mixtral, tiny_llama, lambda: OneAttentionLayer(True)],
    ids=["mixtral", "llama", "masked"],
)
def test_the_priced_gathers_and_rings_are_the_rewrites(build, cp_groups):
    """The cp rewrite of a rank (`rank_program`, on one process) gathers what the cost
    model prices as gathered, takes this rank's chunks again where it prices the
    gradient's gather (a slice of a value that needs a gradient), and runs as rings
    the attentions it prices as rings. Besides: the logits' gather, priced apart, and
    slices of what needs no gradient (the inputs, rotary tables), which cost nothing."""
    ids, _ = token_batch(BATCH_SIZE, SEQ)
    captured = capture(build(), (ids,))
    gm = captured.gm
    analyze(gm, captured.context())
    layout = GraphSummary(gm).cp_layouts.at(2)
    priced = {
        (c.backward, c.source.name)
        for c, _ in layout.collectives
        if c.source and c.op != LOCAL_COPY
    }
    attention = [n for n in gm.graph.nodes if op_name(n, gm) in ATTENTION_OPS]
    rings = {n.name for n in attention if n not in layout.whole}
    grads = {n.name for n, g in gradient_flow(gm, parameter_names(gm)).items() if g}
    plan = make_plan(captured, MESHES[2], Pins.of(cp=2, dp=1, tp=1, pp=1, ep=1))
    [stage] = rank_program(gm, captured.context(target=RankTarget(plan, cp_groups))).stages
    done: dict[str, set[str]] = {"all_gather": set(), "slice": set()}
    for node in stage.graph.nodes:
        info = COLLECTIVE.get(node, None)
        if info is not None and info.axis == "cp":
            done[info.kind].add(node.args[0].name)
    [output] = stage.graph.find_nodes(op="output")
    logits = {n.args[0].name for n in output.all_input_nodes if COLLECTIVE.get(n, None)}
    assert len(logits) == 1
    assert {name for backward, name in priced if not backward} == done["all_gather"] - logits
    assert {name for backward, name in priced if backward} == done["slice"] & grads
    assert {n.name for n in stage.graph.nodes if n.target is ring_attention} == rings


class FixedSequence(nn.Module):
    """Token ids viewed with their sequence's length written out (as Hugging Face's
    GPT-2 views `input_ids`), then embeddings, one masked attention layer, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = OneAttentionLayer(masked=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.layer(ids.view(-1, SEQ))


@pytest.mark.parametrize("build", [tiny_llama, tiny_mixtral, FixedSequence])
def test_one_walk_prices_the_degrees_whose_answers_it_shares(build, monkeypatch):
    """The cp layouts at 2, 4 and 8 ranks come from one walk of the rules, each the
    layout a walk at that degree gives (what runs whole, each collective and its
    bytes); at 3, which does not divide the 16 tokens a view names, the rules answer
    otherwise and the layouts walk again."""
    ids, _ = token_batch(BATCH_SIZE, SEQ)
    captured = capture(build(), (ids,))
    analyze(captured.gm, captured.context())
    fresh = {cp: cp_layout.CpLayouts(captured.gm).at(cp) for cp in (2, 3, 4, 8)}
    walks = []
    walk = cp_layout.cp_propagation
    monkeypatch.setattr(cp_layout, "cp_propagation", lambda *a: walks.append(a) or walk(*a))
    layouts = cp_layout.CpLayouts(captured.gm)
    for cp in (2, 4, 8):
        assert layouts.at(cp) == fresh[cp]
    assert len(walks) == 1
    sizes = [[c.nbytes for c, _ in layouts.at(cp).collectives] for cp in (2, 4)]
    assert sizes[0] != sizes[1]
    asks = build is FixedSequence
    assert layouts.at(3) == fresh[3]
    assert len(walks) == 1 + asks
    if asks:  # the view gathers at 3: its embedding and what follows run whole
        assert fresh[3].whole > fresh[2].whole


def test_a_rule_reading_the_degree_as_a_number_holds_at_it_alone():
    reads = DegreeReads()
    ops = Operands(None, [], [], [], [], 4, reads=reads)
    assert ops.divides(16) and not ops.divides(6) and ops.divided(16) == 4
    assert reads.holds_at(8) and reads.holds_at(16)
    assert not reads.holds_at(2) and not reads.holds_at(3)  # 6 and 16 answer otherwise
    assert ops.tp == 4 and not reads.holds_at(8) and not reads.holds_at(16)
