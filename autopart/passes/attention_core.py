"""The attention core of each repeated block: what selective recomputation recomputes.

Korthikanti et al. (2022) recompute only the part of attention whose saved activations
grow with the sequence squared and whose FLOPs are few: from the product of queries and
keys to the product of the probabilities and values (scale, mask, softmax, dropout
between them). Recomputed, that region keeps only its inputs (q, k, v and the mask);
the score and probability matrices it saved are made again in backward.

A core is found by structure, so the same rule finds it on the captured graph (for the
cost models) and on a rank's rewritten graph (for the recompute pass):
  * a fused attention operator (`scaled_dot_product_attention` and its kernels) is a
    core by itself: it saves q, k, v, its output and the log-sum-exp, and recomputing
    it frees the last two;
  * an unfused softmax attention is the region between the contraction that feeds the
    softmax (through elementwise scaling and masking) and the contraction its
    probabilities feed (through dropout and casts): every node on a path between them.
A region is a core only if nothing outside it reads any of its values but the last
(checks that read a value and produce none are taken in), so it can run as one function
with one output. Only nodes of repeated blocks are considered: recomputation is chosen
per block.
"""

from __future__ import annotations

from torch import fx

from autopart.ops.aten import ATTENTION_OPS, MATMUL_OPS, op_name
from autopart.ops.meta import ATTENTION_CORE, BLOCK
from autopart.passes.runner import PassContext

SOFTMAX_OPS = frozenset({"softmax", "_softmax", "_safe_softmax"})
# What may lie between the scores' contraction and the softmax (scaling, masking, casts)
# and between the softmax and the values' contraction (dropout, casts).
_BEFORE_SOFTMAX = frozenset(
    {"mul", "div", "add", "sub", "where", "masked_fill", "to", "_to_copy", "float", "type_as"}
)
_AFTER_SOFTMAX = frozenset({"dropout", "native_dropout", "to", "_to_copy", "type_as", "float"})
_MAX_STEPS = 8


def attention_core_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    for index, region in enumerate(attention_cores(gm, blocks_only=True)):
        for node in region:
            ATTENTION_CORE.set(node, index)
    return gm


def attention_cores(gm: fx.GraphModule, blocks_only: bool = False) -> list[list[fx.Node]]:
    """Every attention core of `gm`, each as its nodes in graph order. With
    `blocks_only`, only those of repeated blocks (`blocks_pass` first)."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    cores: list[list[fx.Node]] = []
    taken: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node in taken or (blocks_only and BLOCK.get(node, None) is None):
            continue
        name = op_name(node, gm)
        if name in ATTENTION_OPS:
            region = [node]
        elif name in SOFTMAX_OPS:
            region = _around_softmax(gm, node, order)
        else:
            continue
        region = _closed(region, order)
        if region and not taken.intersection(region):
            cores.append(region)
            taken.update(region)
    return cores


def _around_softmax(
    gm: fx.GraphModule, softmax: fx.Node, order: dict[fx.Node, int]
) -> list[fx.Node]:
    scores = _walk_up(gm, softmax)
    values = _walk_down(gm, softmax)
    if scores is None or values is None:
        return []
    # Every node on a path from `scores` to `values`: reachable from the one, reaching
    # the other.
    start, end = order[scores], order[values]
    forward = {scores}
    for node in gm.graph.nodes:
        if start < order[node] <= end and any(a in forward for a in node.all_input_nodes):
            forward.add(node)
    backward, stack = set(), [values]
    while stack:
        node = stack.pop()
        if node in backward or order[node] < start:
            continue
        backward.add(node)
        stack.extend(node.all_input_nodes)
    return sorted(forward & backward, key=order.__getitem__)


def _walk_up(gm: fx.GraphModule, softmax: fx.Node) -> fx.Node | None:
    """The contraction whose scores the softmax normalizes, through scaling and masks."""
    node = softmax
    for _ in range(_MAX_STEPS):
        first = node.args[0] if node.args else None
        if not isinstance(first, fx.Node):
            return None
        name = op_name(first, gm)
        if name in MATMUL_OPS:
            return first
        if name not in _BEFORE_SOFTMAX:
            return None
        node = first
    return None


def _walk_down(gm: fx.GraphModule, softmax: fx.Node) -> fx.Node | None:
    """The contraction the probabilities feed, through dropout and casts."""
    node = softmax
    for _ in range(_MAX_STEPS):
        users = [u for u in node.users if not _is_check(u)]
        if len(users) != 1:
            return None
        (user,) = users
        name = op_name(user, gm)
        if name in MATMUL_OPS:
            return user
        if name == "getitem" and op_name(node, gm) == "native_dropout":
            node = user
            continue
        if name not in _AFTER_SOFTMAX:
            return None
        node = user
    return None


def _is_check(node: fx.Node) -> bool:
    """An operator that reads a value and produces none (a metadata assertion)."""
    return node.op == "call_function" and not node.users and op_name(node).startswith("_assert")


def _closed(region: list[fx.Node], order: dict[fx.Node, int]) -> list[fx.Node]:
    """`region` with the checks that read it, or [] if anything else outside it reads
    any of its values but the last."""
    if not region:
        return []
    members = set(region)
    checks = [u for n in region for u in n.users if u not in members and _is_check(u)]
    members.update(checks)
    last = region[-1]
    if any(u not in members for n in members - {last} for u in n.users):
        return []
    return sorted(members, key=order.__getitem__)
