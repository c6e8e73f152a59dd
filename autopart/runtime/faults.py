"""A peer that leaves the job mid-step, or stops answering, said in words a user can act
on.

The backends report a lost peer as a transport error ("Connection reset by peer ...
GLHF!") on whichever survivor talks to it next; every survivor then fails at its next
collective. A peer that is alive but stopped (a frozen process, a hung device) is
reported by the collective's timeout (`parallelize(..., timeout=...)`) on every rank
that waits for it. `peer_lost` recognizes both, so that every surviving rank stops with
a `PeerLost` that says what happened and how to resume.
"""

from __future__ import annotations

from datetime import timedelta

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


class PeerLost(RuntimeError):
    """A peer process left the job during a step; this rank stops too."""


def peer_lost(error: BaseException, step: int, timeout: timedelta | None = None) -> PeerLost | None:
    """The `PeerLost` that `error` means, raised during training step `step` by a
    collective that waits at most `timeout`, or None."""
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
        f"autopart: {what} Every rank stops here: relaunch the job (torchrun "
        "--max-restarts=N relaunches it for you) and resume from the latest checkpoint "
        "written by autopart.save_checkpoint"
    )
