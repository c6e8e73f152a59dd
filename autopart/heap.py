"""Python's cyclic collector during planning, which makes millions of short-lived objects.

Each collection of the oldest generation walks every object the process holds: torch's
and the model's, and the captured graph's nodes and shapes, which outlive the capture's
analysis and the search. Neither makes garbage among them, so while they run the
collector looks only at the objects made since they began (`gc.freeze`), and returns
the rest to it after.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collecting_only_new_objects() -> Iterator[None]:
    """Within the block, the cyclic collector leaves alone the objects that existed at
    its start. The young generations are collected first, so that what is garbage
    already is not set aside with them; older garbage waits for the first full
    collection after the block. Where the process has already set objects aside
    (`gc.freeze`, as the test ranks do), that choice stands and the block changes
    nothing, as it does inside another such block."""
    if gc.get_freeze_count():
        yield
        return
    gc.collect(1)
    try:
        gc.freeze()
        yield
    finally:
        gc.unfreeze()
