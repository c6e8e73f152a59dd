"""Running a function on a world of local CPU processes over Gloo, for tests and CI.

    results = autopart.testing.run_world(check_my_plan, 4, args...)

Each rank is a spawned process that joins a process group through a file store in a
temporary directory (no ports), runs `fn(*args)`, saves its result for the parent, and
destroys its process group. A failing rank's traceback is raised in the parent; ranks
still running `GRACE_S` after one failed are killed and named.
"""

from __future__ import annotations

import gc
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing import connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_TIMEOUT_S = 600
# Once a rank has failed, how long the others have to finish (they fail too, at their
# next collective) before they are killed: a stopped or hung rank does not hold the run.
GRACE_S = 10


def run_world(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """`fn(*args)` on every rank of a Gloo world; returns each rank's result."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        store = f"file://{tmp}/store"
        procs = [
            ctx.Process(target=_rank_main, args=(fn, rank, world_size, store, tmp, args))
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        late = _wait(procs)
        failures = []
        for rank, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join()
                failures.append(f"rank {rank}: {late}; killed")
            elif p.exitcode != 0:
                err = Path(tmp, f"rank{rank}.err")
                text = err.read_text() if err.exists() else f"rank {rank}: exit {p.exitcode}"
                failures.append(text)
        if failures:
            raise RuntimeError("distributed run failed:\n" + "\n".join(failures))
        return [torch.load(Path(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


def _wait(procs: list) -> str:
    """Wait for every rank, for at most WORLD_TIMEOUT_S, and GRACE_S after the first
    failure; returns what the ranks still running then were late for."""
    deadline = time.monotonic() + WORLD_TIMEOUT_S
    first_failed: int | None = None
    running = {p.sentinel: (rank, p) for rank, p in enumerate(procs)}
    while running:
        ready = connection.wait(list(running), timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        for sentinel in ready:
            rank, p = running.pop(sentinel)
            p.join()
            if p.exitcode != 0 and first_failed is None:
                first_failed = rank
                deadline = min(deadline, time.monotonic() + GRACE_S)
    if first_failed is None:
        return f"did not finish in {WORLD_TIMEOUT_S}s"
    return f"still running {GRACE_S}s after rank {first_failed} failed"


def _rank_main(fn, rank, world_size, store, tmp, args) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world_size)
    try:
        result = fn(*args)
        torch.save(result, Path(tmp, f"rank{rank}.pt"))
    except BaseException:
        Path(tmp, f"rank{rank}.err").write_text(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        # Compiled graphs hold process groups (and work on them): dropped here, and the
        # groups destroyed and collected while the interpreter is whole, not in its
        # teardown, where a Gloo worker thread still holding a tensor aborts the process.
        torch._dynamo.reset()
        dist.destroy_process_group()
        gc.collect()
