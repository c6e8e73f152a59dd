"""Python's cyclic collector during planning, which makes millions of short-lived objects.

A collection of the oldest generation walks every object the process holds: torch's and
the model's, and the captured graph's nodes and shapes, which outlive the capture's
analysis and the search. While they run, the collector takes its young generations
only, which hold nearly all of their garbage; the oldest generation's collections wait
for the block's end, and what garbage reached it is collected then, as usual.

`gc.freeze` would also keep the old objects out of the walks, but a full collection of
the few objects left to it makes the collector think the heap small, and after the
block it walked the whole heap again and again until a full collection corrected it.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

# A threshold the oldest generation's count never reaches in one block.
_NEVER = 2**30


@contextlib.contextmanager
def young_collections_only() -> Iterator[None]:
    """Within the block, the cyclic collector collects its young generations and leaves
    the oldest for after it; the thresholds are restored as they were, also where the
    block is inside another such block."""
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], thresholds[1], _NEVER)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
