"""ZeRO offload's CUDA path on one GPU: its numerics against the same plan without
offload, and its step time and device memory against FSDP2's CPU offload.

    python benchmarks/offload_gpu.py             (on a CUDA machine: a world of 1, NCCL)
    python benchmarks/offload_gpu.py --small     (anywhere: tiny sizes, a quick check)

numerics  a tiny Llama trained 3 steps with and without `offload=True`, both on the
          GPU: fp32 SGD with momentum and fp32 AdamW (the host's step against the
          device's: equal up to rounding), fp16 mixed precision (the loss-scale check
          reads the gradients on the host), and bf16 with fp32 master weights on the
          host (bf16 copies on the device; its update against the device-masters
          run's, within bf16 rounding). Each checks what makes the CUDA path the CUDA
          path: the host copies and their gradient buffers pinned, a side stream for
          the transfers, the optimizer's state on the host.
speed     a Llama of about 0.5B parameters in bf16 mixed precision with AdamW: autopart
          without offload, with offload (fp32 weights on the device), with offload and
          master weights on the host (bf16 copies on the device), and FSDP2
          (`fully_shard` per decoder layer, `CPUOffloadPolicy`, bf16 parameters and
          fp32 reductions), each timed over steps after warm-up in alternating rounds;
          the peak device memory of each, and what stays on it between steps. The
          ratios that matter are autopart's offloaded steps over FSDP2's. FSDP2's
          policy also keeps the parameters on the host between uses, which autopart's
          offload does not (ZeRO-Offload's optimizer state and masters, not
          ZeRO-Infinity's parameters): its device memory is the lower.

One JSON line per part. The last run on an H100 (torch 2.11) is kept in
`data/offload_h100.jsonl`.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import print_json_line
from torch import nn

import autopart

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.models import lm_loss, make_optimizer, tiny_llama, token_batch  # noqa: E402

STEPS = 3


def _device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def _train(offload: bool, optimizer: str, precision: str, master_weights: str = "device") -> dict:
    ids, target = token_batch(8)
    model = tiny_llama()
    pm = autopart.parallelize(
        model,
        autopart.Mesh.local(),
        (ids,),
        loss_fn=lm_loss,
        optimizer=make_optimizer(optimizer),
        precision=precision,
        offload=offload,
        master_weights=master_weights,
    )
    before = {k: v.detach().float().cpu().clone() for k, v in pm.full_state_dict().items()}
    losses = [pm.train_step(ids, target).item() for _ in range(STEPS)]
    out: dict = {"losses": losses, "before": before}
    out["params"] = {k: v.detach().float().cpu() for k, v in pm.full_state_dict().items()}
    host = pm.state.offloaded
    if host is not None:
        stepped = [p for g in pm.optimizer.param_groups for p in g["params"]]
        state = [t for s in pm.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        out["cuda_path"] = {
            "device": sorted({t.device.type for t in host.tensors}),
            "host_pinned": all(h.is_pinned() for h in host.host),
            "grads_pinned": all(g.is_pinned() for g in host._grads),
            "side_stream": host._stream is not None,
            "stepped_on": sorted({p.device.type for p in stepped}),
            "state_on": sorted({t.device.type for t in state if t.dim() > 0}),
        }
    pm.close()
    return out


def _update_error(got: dict, want: dict, before: dict) -> float:
    err = sum(float(((got[n] - want[n]) ** 2).sum()) for n in want) ** 0.5
    moved = sum(float(((want[n] - before[n]) ** 2).sum()) for n in want) ** 0.5
    return err / moved


def numerics() -> dict:
    cases = {
        "fp32 sgd": ("sgd", "fp32", "device"),
        "fp32 adamw": ("adamw", "fp32", "device"),
        "fp16-mixed sgd": ("sgd", "fp16-mixed", "device"),
        "bf16 host masters sgd": ("sgd", "bf16-mixed", "host"),
    }
    out: dict = {}
    for name, (optimizer, precision, masters) in cases.items():
        on_device = _train(False, optimizer, precision)
        offloaded = _train(True, optimizer, precision, masters)
        loss_err = max(
            abs(a - b) / abs(b)
            for a, b in zip(offloaded["losses"], on_device["losses"], strict=True)
        )
        update_err = _update_error(offloaded["params"], on_device["params"], on_device["before"])
        out[name] = {
            "losses": [round(x, 6) for x in offloaded["losses"]],
            "loss_rel_err": float(f"{loss_err:.3g}"),
            "update_rel_err": float(f"{update_err:.3g}"),
            **offloaded.get("cuda_path", {}),
        }
    return out


def _llama(small: bool) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    sizes = (
        {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 256}
        if small
        else {
            "hidden_size": 2048,
            "intermediate_size": 5632,
            "num_hidden_layers": 8,
            "vocab_size": 32000,
        }
    )
    config = LlamaConfig(
        **sizes,
        num_attention_heads=16 if not small else 4,
        num_key_value_heads=8 if not small else 2,
        max_position_embeddings=2048,
        use_cache=False,
    )
    return LlamaForCausalLM(config)


def _loss(output, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.flatten(0, 1).float(), target.flatten())


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


def _autopart_step(small: bool, ids, target, offload: bool, master_weights: str = "device"):
    pm = autopart.parallelize(
        _llama(small),
        autopart.Mesh.local(),
        (ids,),
        loss_fn=_loss,
        optimizer=_adamw,
        precision="bf16-mixed",
        offload=offload,
        master_weights=master_weights,
    )
    return (lambda: pm.train_step(ids, target).item()), pm.close


def _fsdp_step(small: bool, ids, target):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    device = _device()
    model = _llama(small).to(device)
    mesh = init_device_mesh(device.type, (1,))
    policy = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        "offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda"),
    }
    for layer in model.model.layers:
        fully_shard(layer, **policy)
    fully_shard(model, **policy)
    optimizer = _adamw(model.parameters())

    def step() -> float:
        loss = _loss(model(ids), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step, lambda: None


def speed(small: bool, steps: int, rounds: int) -> dict:
    device = _device()
    batch, seq = (4, 32) if small else (8, 1024)
    g = torch.Generator().manual_seed(0)
    vocab = 256 if small else 32000
    ids = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
    target = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
    builders = {
        "autopart": lambda: _autopart_step(small, ids, target, offload=False),
        "autopart_offload": lambda: _autopart_step(small, ids, target, offload=True),
        "autopart_offload_host_masters": lambda: _autopart_step(
            small, ids, target, offload=True, master_weights="host"
        ),
        "fsdp2_cpu_offload": lambda: _fsdp_step(small, ids, target),
    }
    times: dict[str, list[float]] = {k: [] for k in builders}
    memory: dict[str, float] = {}
    resident: dict[str, float] = {}
    losses: dict[str, float] = {}
    for _ in range(rounds):
        for name, build in builders.items():
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            step, close = build()
            for _ in range(2):  # warm-up
                step()
            start = time.perf_counter()
            for _ in range(steps):
                losses[name] = step()
            if device.type == "cuda":
                torch.cuda.synchronize()
                memory[name] = torch.cuda.max_memory_allocated() / 2**30
                resident[name] = torch.cuda.memory_allocated() / 2**30  # between steps
            times[name].append((time.perf_counter() - start) / steps)
            close()
            del step, close  # the next build's peak must not count this one's memory
    median = {k: statistics.median(v) for k, v in times.items()}
    return {
        "params_m": round(sum(p.numel() for p in _llama(small).parameters()) / 1e6, 1),
        "step_s": {k: round(v, 4) for k, v in median.items()},
        "peak_gib": {k: round(v, 2) for k, v in memory.items()},
        "resident_gib": {k: round(v, 2) for k, v in resident.items()},
        "last_loss": {k: round(v, 4) for k, v in losses.items()},
        "offload_vs_fsdp2": round(median["autopart_offload"] / median["fsdp2_cpu_offload"], 3),
        "offload_vs_on_device": round(median["autopart_offload"] / median["autopart"], 3),
        "host_masters_vs_fsdp2": round(
            median["autopart_offload_host_masters"] / median["fsdp2_cpu_offload"], 3
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny sizes: a quick check")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--part", choices=["numerics", "speed", "both"], default="both")
    args = parser.parse_args()
    autopart.Mesh.local()  # a world of 1: NCCL on a GPU, Gloo on a CPU
    env = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
    }
    if args.part in ("numerics", "both"):
        print_json_line({"benchmark": "offload_gpu.numerics", **env, "cases": numerics()})
    if args.part in ("speed", "both"):
        print_json_line(
            {"benchmark": "offload_gpu.speed", **env, **speed(args.small, args.steps, args.rounds)}
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
