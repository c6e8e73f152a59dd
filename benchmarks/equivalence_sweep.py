"""Property-based equivalence at scale: random models under random pins, each trained
on a local Gloo world and compared with one device.

    python benchmarks/equivalence_sweep.py [--examples 200]

The cases come from `tests/random_models.py`'s hypothesis strategy (derandomized: the
same cases every run). Each either matches one device (losses and parameters within
1e-4 after 3 SGD steps), is refused with an error that says why, or fails. Cases of one
world size run in one world; a world that crashes is run again case by case, so that
a crash is charged to its own case. Prints one JSON line per failure and a summary line
with the pass / refused / fail counts and the refusals' reasons.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # for `tests`

from harness import print_json_line  # noqa: E402

from autopart.testing import run_world  # noqa: E402
from tests.random_models import Case, drawn, outcome, reference, run_cases  # noqa: E402


def judge(cases: list[Case], world: int) -> list[str]:
    """Each case's verdict: the worst over the world's ranks."""
    try:
        per_rank = run_world(run_cases, world, cases)
    except RuntimeError as e:
        if len(cases) == 1:
            return [f"fail: crashed: {str(e).strip().splitlines()[-1][:300]}"]
        return [v for case in cases for v in judge([case], world)]
    verdicts = []
    for i, case in enumerate(cases):
        want = reference(case)
        found = {outcome(results[i], want) for results in per_rank}
        failures = sorted(v for v in found if v.startswith("fail"))
        if failures:
            verdicts.append(failures[0])
        elif "refused" in found:
            verdicts.append("refused: " + per_rank[0][i].get("refused", "")[:90])
        else:
            verdicts.append("pass")
    return verdicts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--chunk", type=int, default=25, help="cases per world")
    args = parser.parse_args()
    cases = drawn(args.examples)
    counts: collections.Counter[str] = collections.Counter()
    reasons: collections.Counter[str] = collections.Counter()
    for world in sorted({c.world for c in cases}):
        group = [c for c in cases if c.world == world]
        for start in range(0, len(group), args.chunk):
            chunk = group[start : start + args.chunk]
            for case, verdict in zip(chunk, judge(chunk, world)):
                counts[verdict.split(":")[0]] += 1
                if verdict.startswith("refused"):
                    reasons[verdict.removeprefix("refused: ")] += 1
                if verdict.startswith("fail"):
                    print_json_line(
                        {
                            "benchmark": "equivalence_sweep",
                            "case": repr(case),
                            "verdict": verdict[:500],
                        }
                    )
    print_json_line(
        {
            "benchmark": "equivalence_sweep",
            "examples": len(cases),
            "pass": counts["pass"],
            "refused": counts["refused"],
            "fail": counts["fail"],
            "refusals": dict(reasons.most_common()),
        }
    )


if __name__ == "__main__":
    main()
