"""Two torchrun launchers (--nnodes 2, c10d rendezvous on 127.0.0.1), two processes each:
the mesh reads the node layout from the launchers, tensor parallelism stays inside a
node, and training matches one device."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path

import pytest

from tests.models import tiny_llama, token_batch, train_reference

ROOT = Path(__file__).parents[2]
JOB = Path(__file__).with_name("two_node_job.py")
STEPS, BATCH = 3, 8
TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launcher(hosts_store: bool, port: int, run_id: str, out: Path) -> list[str]:
    """One node's torchrun. The c10d rendezvous numbers the nodes itself (--node-rank is
    for the static backend only). Both launchers live on the endpoint's host, so each is
    told whether it hosts the rendezvous store rather than left to guess from its address;
    --local-addr makes the address the workers meet at 127.0.0.1, not this host's name."""
    return [
        *(sys.executable, "-m", "torch.distributed.run"),
        *("--nnodes", "2", "--nproc-per-node", "2", "--max-restarts", "0"),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id),
        *("--rdzv-conf", f"is_host={int(hosts_store)}", "--local-addr", "127.0.0.1"),
        *(str(JOB), "--steps", str(STEPS), "--batch", str(BATCH), "--out", str(out)),
    ]


def _check_exit(process: subprocess.Popen) -> None:
    if process.wait() != 0:
        raise subprocess.CalledProcessError(process.returncode, process.args)


def _start(command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    # Output goes to a file: a full pipe that nobody reads would stall the launcher.
    with log.open("w") as output:  # the child holds its own copy of the descriptor
        return subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env)


def _run_together(commands: list[list[str]], logs: list[Path], env: dict[str, str]) -> None:
    """Run the commands side by side until all succeed. The first to fail, or the time
    running out, stops the others: their workers would otherwise wait on a lost peer."""
    processes: list[subprocess.Popen] = []
    with ThreadPoolExecutor(len(commands)) as pool:
        try:
            for command, log in zip(commands, logs):
                processes.append(_start(command, log, env))
            waits = [pool.submit(_check_exit, p) for p in processes]
            done, _ = wait(waits, timeout=TIMEOUT_S, return_when=FIRST_EXCEPTION)
            for finished in done:
                finished.result()  # raises for a launcher that failed
            if len(done) < len(waits):
                raise TimeoutError(f"the launchers ran past {TIMEOUT_S} s")
        finally:
            for p in processes:
                _stop(p)


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM lets torchrun stop its workers (each in a session of its own, out of reach
    of a signal to the launcher's group) before it exits; SIGKILL if it does not."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.mark.slow  # launches processes of its own: kept out of the quick suite
def test_two_launchers_give_a_two_node_mesh_with_tp_inside_each_node(tmp_path):
    port, run_id, out = _free_port(), f"two-nodes-{uuid.uuid4().hex}", tmp_path / "report.json"
    commands = [_launcher(node == 0, port, run_id, out) for node in (0, 1)]
    logs = [tmp_path / f"node{node}.log" for node in (0, 1)]
    # PYTHONPATH: the job imports the test models from the checkout
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    try:
        _run_together(commands, logs, env)
    except (subprocess.CalledProcessError, TimeoutError) as error:
        tails = "\n".join(f"== {log.name}\n{log.read_text()[-3000:]}" for log in logs)
        pytest.fail(f"{error}\n{tails}")

    report = json.loads(out.read_text())
    assert report["mesh"] == {"nodes": 2, "per_node": 2}
    assert report["plan"] == {"dp": 2, "tp": 2, "pp": 1}
    ranks = report["ranks"]
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2, 3]
    # each node holds two consecutive ranks, and a TP group is exactly one node's ranks
    node_of = {r["rank"]: r["node"] for r in ranks}
    assert sorted(node_of.values()) == [0, 0, 1, 1]
    for r in ranks:
        assert r["tp_group"] == [q for q in range(4) if node_of[q] == r["node"]]
    assert {tuple(r["tp_group"]) for r in ranks} == {(0, 1), (2, 3)}

    ids, target = token_batch(BATCH)
    reference = train_reference(tiny_llama(), "adamw", STEPS, (ids,), target)["losses"]
    assert report["losses"] == pytest.approx(reference, rel=1e-5)
