"""`benchmarks/gpu_step.py --small`: the GPU benchmark's smoke test on the CPU, a world of
one process, tiny sizes, one round of one step. It checks what the line says, never a
time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "gpu_step.py"


@pytest.mark.slow  # three programs, two of them compiled by inductor
def test_gpu_step_runs_every_side_at_a_tiny_size(tmp_path):
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--small", "--steps", "1", "--rounds", "1"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=False,
        timeout=1200,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    line = json.loads(next(x for x in run.stdout.splitlines() if x.startswith("{")))
    assert line["autopart_precision"] == "bf16-params"
    assert set(line["tokens_per_s"]) == {"autopart", "autopart_compiled", "fsdp2_compiled"}
    assert all(rate > 0 for rate in line["tokens_per_s"].values())
    # Each side trained the same model on the same batch: their losses at bf16's resolution.
    losses = list(line["last_loss"].values())
    assert max(losses) - min(losses) <= 2.0**-6 * max(losses)
