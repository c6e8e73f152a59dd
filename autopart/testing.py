"""Running a function on a world of local CPU processes over Gloo, for tests and CI.

    results = autopart.testing.run_world(check_my_plan, 4, args...)

Each rank is a fresh process that joins a process group through a file store in a
temporary directory (no ports), runs `fn(*args)`, saves its result for the parent, and
destroys its process group. A failing rank's traceback is raised in the parent; ranks
still running `GRACE_S` after one failed are killed and named.

Ranks are forked from a server process (multiprocessing's "forkserver") that imported
torch, autopart, what torch.export imports on its first capture and the module of the
first world's `fn` once, and nothing else ran there: a rank starts in milliseconds
instead of the seconds an interpreter takes to import them (5.6 s for torch, autopart
and Hugging Face `transformers` on a 2-core host, per rank and per world). `preload`
names more modules to import there, before the first world. A rank gets the caller's
environment variables, working directory and `sys.path` as they are at each call;
what a process reads only as it starts (glibc's `MALLOC_*` settings) it has as the
server had them at the first world.
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

from autopart.compile import release_compiled_graphs

WORLD_TIMEOUT_S = 600
# Once a rank has failed, how long the others have to finish (they fail too, at their
# next collective) before they are killed: a stopped or hung rank does not hold the run.
GRACE_S = 10


# What torch.export imports on its first capture in a process: imported in the server, a
# rank that captures its model starts from them. A module missing from another torch
# version is skipped (the forkserver ignores a preload module it cannot import).
FIRST_CAPTURE_IMPORTS = [
    "torch.export._trace",
    "torch.export._unlift",
    "torch.export.pt2_archive",
    "torch._export.non_strict_utils",
    "torch._export.passes.add_runtime_assertions_for_constraints_pass",
    "torch._export.passes.collect_tracepoints_pass",
    "torch._export.passes.replace_autocast_with_hop_pass",
    "torch._export.passes.replace_set_grad_with_hop_pass",
    "torch._export.serde.serialize",
    "torch._export.db.logging",
    "torch._functorch.aot_autograd",
    "torch._functorch.partitioners",
    "torch._functorch._activation_checkpointing.graph_info_provider",
    "torch._inductor.codecache",
    "torch._inductor.sizevars",
    "torch._inductor.fx_passes.dedupe_symint_uses",
    "torch._subclasses.schema_check_mode",
    "torch.fx.experimental.validator",
    "sympy.combinatorics",
    "sympy.sets.setexpr",
    "sympy.tensor.tensor",
]
# What the forkserver imports before it forks the first rank (`preload` adds more).
PRELOAD = ["torch", "torch.distributed", "autopart", *FIRST_CAPTURE_IMPORTS]


def preload(*modules: str) -> None:
    """Import `modules` once in the process that ranks are forked from, not in every
    rank. Takes effect if called before the first `run_world` of this process."""
    PRELOAD.extend(m for m in modules if m not in PRELOAD)


def run_world(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """`fn(*args)` on every rank of a Gloo world; returns each rank's result."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, fn.__module__])  # a no-op once it runs
    environment = dict(os.environ)  # the server's is that of the first world's caller
    with tempfile.TemporaryDirectory() as tmp:
        store = f"file://{tmp}/store"
        procs = [
            ctx.Process(
                target=_rank_main, args=(fn, rank, world_size, store, tmp, args, environment)
            )
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


def _rank_main(fn, rank, world_size, store, tmp, args, environment) -> None:
    # The rank starts with the server's heap: every object of torch, autopart and the
    # preloaded models. A collection of the oldest generation would walk them all (and,
    # writing each one's header, copy every page of them from the server), as would the
    # one at the end. They live as long as the rank, so they are left out of collection.
    gc.freeze()
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world_size)
    # Gloo's init returns on a rank once its own side of every pair is connected: a rank
    # whose `fn` needs no collective could finish and close its sockets while a peer is
    # still connecting to it, failing the peer's init ("Connection closed by peer").
    dist.barrier()
    try:
        result = fn(*args)
        torch.save(result, Path(tmp, f"rank{rank}.pt"))
    except BaseException:
        Path(tmp, f"rank{rank}.err").write_text(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        # As a user's script ends: the groups destroyed, then the compiled graphs that
        # hold them released (what the backend registers at exit), while the
        # interpreter is whole.
        dist.destroy_process_group()
        release_compiled_graphs()
