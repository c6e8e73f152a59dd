"""The local operators a sharding rule swaps in for an operator (`Decision.local_op`),
by name: each is called with the node's arguments and the process group of the axis
the rewrite shards over, and with `dim_order=`, the dim order of the node's captured
value, in which it returns its own (`ops.layout`: the graph's views were traced
against that layout)."""

from __future__ import annotations

from collections.abc import Callable

from autopart.ops.context_parallel import ring_attention
from autopart.ops.vocab_parallel import vocab_parallel_embedding

LOCAL_OPS: dict[str, Callable] = {
    "vocab_parallel_embedding": vocab_parallel_embedding,
    "ring_attention": ring_attention,
}
