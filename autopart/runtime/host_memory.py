"""Freed host memory kept for reuse, as a GPU's caching allocator keeps device memory.

PyTorch's CPU allocator has no cache of its own: it asks glibc's malloc, which gives
large blocks back to the kernel as soon as they are freed (blocks above its mmap
threshold, and the heap's top beyond its trim threshold). A training step allocates
the same sizes every step, so each step's large outputs and the optimizer's
temporaries fault in fresh, zeroed pages again (figures: `docs/cost-models.md`). The
cost models price a step as a caching allocator runs it, with no page faults.

`keep_freed_memory` raises both thresholds for the process, as setting glibc's
`MALLOC_MMAP_THRESHOLD_` and `MALLOC_TRIM_THRESHOLD_` before it starts would: blocks
up to glibc's largest mmap threshold come from the heap and stay there for the next
step. jemalloc and tcmalloc, which PyTorch's CPU tuning guide recommends, keep freed
memory too. A CPU rank sets them when its runtime is built; `AUTOPART_KEEP_FREED_MEMORY=0`
leaves the allocator as it is.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform

ENVIRONMENT = "AUTOPART_KEEP_FREED_MEMORY"
M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts on a 64-bit host
TRIM_THRESHOLD = 1 << 30  # freed memory the heap may keep before it is trimmed


@functools.cache
def keep_freed_memory() -> bool:
    """Whether this process's malloc now keeps freed blocks for reuse: False where the
    C library is not glibc or the environment opts out."""
    if os.environ.get(ENVIRONMENT, "1") == "0" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
