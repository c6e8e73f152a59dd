"""`autopart.testing.run_world`: ranks forked from a preloaded server still run in the
caller's environment and working directory as they are at each call, and leave the
server's objects out of their garbage collections."""

from __future__ import annotations

import gc
import os
import sys

import torch.distributed as dist

from autopart.testing import run_world


def _where_am_i() -> tuple[int, str | None, str, bool, bool]:
    return (
        dist.get_rank(),
        os.environ.get("AUTOPART_TEST_MARK"),
        os.getcwd(),
        "tests.models" in sys.modules,  # preloaded by tests/conftest.py
        gc.get_freeze_count() > len(sys.modules),  # the server's heap, frozen
    )


def test_ranks_see_the_callers_environment_and_directory_at_each_call(tmp_path, monkeypatch):
    run_world(_where_am_i, 2)  # the server is running from here on, if not before
    for mark, directory in (("first", tmp_path), ("second", tmp_path / "inner")):
        directory.mkdir(exist_ok=True)
        monkeypatch.setenv("AUTOPART_TEST_MARK", mark)
        monkeypatch.chdir(directory)
        assert run_world(_where_am_i, 2) == [(r, mark, str(directory), True, True) for r in (0, 1)]
