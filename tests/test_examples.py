"""The examples the README lists run as documented: each is launched as a user would."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[1] / "examples"


def _run(command: list[str], cwd: Path) -> str:
    # A process killed by a signal (an abort at exit) prints every thread's Python stack,
    # ahead of the launcher's summary: the failure shows where it was.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    job = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=cwd)
    output = job.stdout + job.stderr
    assert job.returncode == 0, output[-12000:]
    return output


@pytest.mark.slow  # launches processes of its own: kept out of the quick suite
def test_the_main_job_prints_its_plan_and_matches_one_device(tmp_path):
    output = _run(
        [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
            *("--nproc-per-node", "2", str(EXAMPLES / "train_llama.py"), "--steps", "3"),
        ],
        tmp_path,
    )
    assert "predicted" in output.lower()  # the plan, printed
    assert "2 processes vs one device: losses match" in output


@pytest.mark.slow  # launches processes of its own: kept out of the quick suite
@pytest.mark.parametrize(
    ("pins", "backend"),
    [((), "'autopart'"), (("--tp", "2", "--zero", "3"), "autopart.backend(tp=2, zero=3)")],
)
def test_the_compile_backend_example_trains_like_one_device(tmp_path, pins, backend):
    output = _run(
        [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
            *("--nproc-per-node", "2", str(EXAMPLES / "compile_backend.py"), "--steps", "3"),
            *pins,
        ],
        tmp_path,
    )
    assert f"torch.compile(backend={backend}) on 2 processes vs one device: losses match" in output


@pytest.mark.slow  # plans a 70B model on the meta device: about half a minute
def test_the_70b_planning_example_writes_the_plan_and_its_report(tmp_path):
    script = str(EXAMPLES / "plan_llama_70b.py")
    output = _run([sys.executable, script, "--out", "report"], tmp_path)
    report = tmp_path / "report"
    assert (report / "plan.json").exists() and (report / "index.html").exists()
    page = (report / "index.html").read_text()
    assert all(f'id="{figure}"' in page for figure in ("timeline", "memory", "alternatives"))
    assert "planned in" in output


@pytest.mark.slow  # launches processes of its own: kept out of the quick suite
def test_the_resume_example_writes_to_a_temporary_directory_and_removes_it(tmp_path):
    """Both attempts of the job (the first loses a rank, torchrun relaunches it) find one
    temporary directory; nothing is written where it runs."""
    output = _run(
        [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
            *("--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "5"),
            *(str(EXAMPLES / "resume.py"), "--steps", "4", "--kill-at", "2"),
        ],
        tmp_path,
    )
    assert "attempt 1: dp=1 tp=2 pp=1 zero=0, resuming after step 2" in output
    assert "4 steps over 2 attempts vs one device: losses match" in output
    removed = re.search(r"removed (\S+), the temporary directory", output)
    assert removed is not None, output[-2000:]
    directory = Path(removed[1])
    assert directory.parent == Path(tempfile.gettempdir()) and not directory.exists()
    assert f"attempt 0: dp=2 tp=1 pp=1 zero=1, starting afresh in {directory}" in output
    assert list(tmp_path.iterdir()) == []
