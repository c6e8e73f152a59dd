"""The examples the README lists run as documented: each is launched as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[1] / "examples"


def _run(command: list[str], cwd: Path) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    job = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=cwd)
    output = job.stdout + job.stderr
    assert job.returncode == 0, output[-4000:]
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
