"""A peer that leaves the job mid-step, or stops answering, said in words a user can act
on.

The backends report a lost peer as a transport error ("Connection reset by peer ...
GLHF!") on whichever survivor talks to it next; every survivor then fails at its next
collective. A peer that is alive but stopped (a frozen process, a hung device) is
reported by the collective's timeout (`parallelize(..., timeout=...)`) on every rank
that waits for it. `peer_lost` recognizes both, so that every surviving rank stops with
a `PeerLost` that says what happened, which rank it was, and how to resume.

Which rank: the backends name only a peer's address. Each rank records its host and
process id in the job's store when it is parallelized (`register_process`); a survivor
reads them back and names the ranks on its host whose process has exited, or is
stopped (`lost_ranks`). Ranks on other hosts cannot be told apart that way, nor any
rank once the store is gone (a TCP store served by the lost rank itself, where the job
was started without torchrun); the error then says so.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

# Transport errors that mean the other side of a collective is gone (Gloo's TCP pairs,
# NCCL's aborted communicators).
_LOST_PEER = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
)


# The same for a collective that waited out its timeout (Gloo, NCCL's watchdog).
_TIMED_OUT = ("Timed out waiting", "Watchdog caught collective operation timeout")


_PROCESS_KEY = "autopart/process/{rank}"


class PeerLost(RuntimeError):
    """A peer process left the job during a step; this rank stops too."""


def register_process() -> None:
    """Record this rank's host and process id in the job's store (`lost_ranks`)."""
    store = _store()
    if store is not None:
        where = f"{socket.gethostname()} {os.getpid()}"
        store.set(_PROCESS_KEY.format(rank=dist.get_rank()), where)


def lost_ranks() -> dict[int, str] | None:
    """The ranks on this host whose process has exited ("exited") or is stopped
    ("stopped"), or None when the store cannot be read (it may have gone with the lost
    rank)."""
    store = _store()
    if store is None:
        return None
    here, out = socket.gethostname(), {}
    try:
        for rank in range(dist.get_world_size()):
            key = _PROCESS_KEY.format(rank=rank)
            if rank == dist.get_rank() or not store.check([key]):
                continue
            host, pid = store.get(key).decode().split()
            state = _process_state(int(pid)) if host == here else None
            if state is not None:
                out[rank] = state
    except (RuntimeError, ValueError, OSError):
        return None
    return out


def _process_state(pid: int) -> str | None:
    """ "exited" (gone, a zombie, or on its way out), "stopped", or None while it runs."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return "exited"
    state, flags = fields[0], int(fields[6])
    # A killed process closes its sockets (which is how its peers learn of it) while it
    # exits, before it turns zombie: the kernel has marked it exiting by then.
    if flags & _PF_EXITING:
        return "exited"
    return {"Z": "exited", "X": "exited", "T": "stopped", "t": "stopped"}.get(state)


_PF_EXITING = 0x4  # the kernel's task flag for a process in do_exit (include/linux/sched.h)


def _store() -> dist.Store | None:
    if not dist.is_initialized():
        return None
    return dist.distributed_c10d._get_default_store()


def _named(lost: dict[int, str] | None) -> str:
    if lost is None:
        return " Which rank could not be told: the job's store went with it."
    if not lost:
        return " No rank on this host is gone: the lost one ran on another host."
    gone = "; ".join(f"rank {r}'s process has {state}" for r, state in sorted(lost.items()))
    return f" {gone}."


def peer_lost(
    error: BaseException,
    step: int,
    timeout: timedelta | None = None,
    who: Callable[[], dict[int, str] | None] = lost_ranks,
) -> PeerLost | None:
    """The `PeerLost` that `error` means, raised during training step `step` by a
    collective that waits at most `timeout`, or None. `who` names the ranks that are
    gone (`lost_ranks`)."""
    text = str(error)
    reported = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    if any(marker in text for marker in _TIMED_OUT):
        limit = f"{timeout.total_seconds():g} s" if timeout else "its"
        what = (
            f"a collective of training step {step} waited out {limit} timeout: a peer "
            f"process stopped answering (frozen, hung, or far slower than the others; the "
            f"backend reports: {reported}). If steps can take that long, raise "
            "parallelize(..., timeout=...)."
        )
    elif any(marker in text for marker in _LOST_PEER):
        what = (
            f"a peer process left the job during training step {step} (the backend "
            f"reports: {reported})."
        )
    else:
        return None
    return PeerLost(
        f"autopart: {what}{_named(who())} Every rank stops here: relaunch the job (torchrun "
        "--max-restarts=N relaunches it for you) and resume from the latest checkpoint "
        "written by autopart.save_checkpoint (autopart.load_checkpoint reads it, under any plan)"
    )
