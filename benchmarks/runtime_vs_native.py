"""autopart's runtime against the PyTorch-native way of doing the same, pair by pair.

    python benchmarks/runtime_vs_native.py

    autopart plan   PyTorch-native baseline                              target ratio
    ZeRO-3          FSDP2 `fully_shard`                (zero3_vs_fsdp.py)      <= 1.05
    TP              `parallelize_module`               (tp_vs_native.py)       <= 1.0
    PP              a hand split with pipelining       (pp_vs_pipelining.py)   <= 1.05
    dp, compiled    DDP over torch.compile             (compiled_vs_native.py) <= 1.05
    ZeRO-3, bf16-params, compiled
                    FSDP2 per block, MixedPrecisionPolicy(bf16, fp32), each block
                    compiled                           (compiled_vs_native.py) <= 1.05

Each pair trains the same model on the same world and batch, in one run, alternating
between the two; this script runs them all and prints their JSON lines, one per pair.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PAIRS = (
    ("zero3_vs_fsdp.py",),
    ("tp_vs_native.py",),
    ("pp_vs_pipelining.py",),
    ("compiled_vs_native.py", "--pair", "ddp"),
    ("compiled_vs_native.py", "--pair", "fsdp2"),
)


def main() -> int:
    here = Path(__file__).parent
    status = 0
    for script, *options in PAIRS:
        run = subprocess.run(
            [sys.executable, str(here / script), *options],
            capture_output=True,
            text=True,
            check=False,
        )
        lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
        if run.returncode or not lines:
            print(f'{{"benchmark": "{script}", "error": "exit {run.returncode}"}}', flush=True)
            sys.stderr.write(run.stderr[-4000:])
            status = 1
        for line in lines:
            print(line, flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
