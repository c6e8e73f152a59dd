"""The job tests/runtime/test_two_nodes.py runs under two torchrun launchers (--nnodes 2).

It trains a tiny Llama with tensor parallelism pinned to 2 and data parallelism to 2,
each rank prints the mesh autopart read from the launchers and its tensor-parallel group,
and rank 0 writes what the test checks as JSON (`--out`): the mesh, the plan, every
rank's node and tensor-parallel group, and each step's loss.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import autopart
from tests.models import lm_loss, make_optimizer, tiny_llama, token_batch


def placement(pm: autopart.ParallelModule) -> dict:
    """This rank, the node it runs on (torchrun's GROUP_RANK: the launcher that started
    it) and the global ranks of its tensor-parallel group."""
    return {
        "rank": dist.get_rank(),
        "node": int(os.environ["GROUP_RANK"]),
        "tp_group": dist.get_process_group_ranks(pm.groups.group(autopart.Axis.TP)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    mesh = autopart.Mesh.local()
    ids, target = token_batch(args.batch)
    pm = autopart.parallelize(
        tiny_llama(), mesh, (ids,), loss_fn=lm_loss, optimizer=make_optimizer("adamw"), tp=2, dp=2
    )
    mine = placement(pm)
    print(
        f"rank {mine['rank']}: mesh {mesh.nodes} nodes × {mesh.per_node} per node, "
        f"on node {mine['node']}, tp group {mine['tp_group']}",
        flush=True,
    )
    placements: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(placements, mine)

    losses = [pm.train_step(ids, target).item() for _ in range(args.steps)]
    if dist.get_rank() == 0:
        plan = pm.plan
        report = {
            "mesh": {"nodes": mesh.nodes, "per_node": mesh.per_node},
            "plan": {"dp": plan.dp, "tp": plan.tp, "pp": plan.pp},
            "ranks": placements,
            "losses": losses,
        }
        args.out.write_text(json.dumps(report, indent=1))
    pm.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
