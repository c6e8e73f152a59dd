"""Faults: a rank killed mid-training stops the others at once, and a frozen one at the
collectives' timeout, with an error that says what happened and how to resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch.distributed as dist

from autopart.runtime.faults import _process_state
from autopart.testing import run_world
from tests.harness import parallelize_lm
from tests.models import LM_FACTORIES, token_batch


def _killed_after_one_step(batch, victim: int) -> None:
    pm = parallelize_lm(LM_FACTORIES["llama"](), batch, dp=2)
    pm.train_step(*batch)
    if dist.get_rank() == victim:
        os.kill(os.getpid(), signal.SIGKILL)  # as an out-of-memory killer would
    pm.train_step(*batch)


@pytest.mark.parametrize("victim", [1, pytest.param(0, marks=pytest.mark.slow)])
def test_a_killed_rank_stops_the_others_with_a_named_error(victim):
    with pytest.raises(RuntimeError) as failed:
        run_world(_killed_after_one_step, 2, token_batch(8), victim)
    message = str(failed.value)
    assert f"rank {victim}: exit -9" in message  # the killed rank
    assert "PeerLost: autopart: a peer process left the job during training step 1" in message
    assert f"rank {victim}'s process has exited." in message  # named by the survivor
    assert "resume from the latest checkpoint" in message


def _stopped_after_one_step(batch) -> None:
    pm = parallelize_lm(LM_FACTORIES["llama"](), batch, dp=2, timeout=STOPPED_TIMEOUT_S)
    pm.train_step(*batch)
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen: alive, but answers nothing
    pm.train_step(*batch)


# Long enough that a busy machine does not time out a healthy step.
STOPPED_TIMEOUT_S = 30


@pytest.mark.slow  # it waits out the timeout
def test_a_frozen_rank_stops_the_others_at_the_timeout_with_a_named_error():
    with pytest.raises(RuntimeError) as failed:
        run_world(_stopped_after_one_step, 2, token_batch(8))
    message = str(failed.value)
    assert "rank 1: still running" in message and "after rank 0 failed; killed" in message
    assert (
        f"PeerLost: autopart: a collective of training step 1 waited out {STOPPED_TIMEOUT_S} s "
        "timeout: a peer process stopped answering"
    ) in message
    assert "rank 1's process has stopped." in message
    assert "raise parallelize(..., timeout=...)" in message


def test_a_process_is_told_running_stopped_or_exited():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert _process_state(child.pid) is None
        os.kill(child.pid, signal.SIGSTOP)
        os.waitpid(child.pid, os.WUNTRACED)  # returns once it has stopped
        assert _process_state(child.pid) == "stopped"
        os.kill(child.pid, signal.SIGKILL)
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, still a zombie
        assert _process_state(child.pid) == "exited"
    finally:
        child.kill()
        child.wait()
    assert _process_state(child.pid) == "exited"  # reaped: gone from /proc
