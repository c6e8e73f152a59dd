"""A peer that leaves the job mid-step, said in words a user can act on.

The backends report a lost peer as a transport error ("Connection reset by peer ...
GLHF!") on whichever survivor talks to it next; every survivor then fails at its next
collective. `peer_lost` recognizes those errors so that every surviving rank stops with
the same `PeerLost`, which says what happened and how to resume.
"""

from __future__ import annotations

# Transport errors that mean the other side of a collective is gone (Gloo's TCP pairs,
# NCCL's aborted communicators).
_LOST_PEER = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
)


class PeerLost(RuntimeError):
    """A peer process left the job during a step; this rank stops too."""


def peer_lost(error: BaseException, step: int) -> PeerLost | None:
    """The `PeerLost` that `error` means, raised during training step `step`, or None."""
    text = str(error)
    if not any(marker in text for marker in _LOST_PEER):
        return None
    reported = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return PeerLost(
        f"autopart: a peer process left the job during training step {step} (the "
        f"backend reports: {reported}). Every rank stops here: relaunch the job "
        "(torchrun --max-restarts=N relaunches it for you) and resume from the latest "
        "checkpoint written by autopart.save_checkpoint"
    )
