"""autopart's training step on one GPU against what a torchtitan user would run.

    python benchmarks/gpu_step.py            (on a CUDA machine: a world of 1, NCCL)
    python benchmarks/gpu_step.py --small    (anywhere: tiny sizes, a smoke test)
    python benchmarks/gpu_step.py --precision bf16-mixed   (autopart under autocast)

A Llama-style model of about 1B parameters (18 layers of width 2048, GQA 16/8 heads,
vocabulary 32000) in bf16 with AdamW, at sequence 2048; autopart with
`precision="bf16-params"` (the baseline's policy: bf16 parameters, fp32 masters and
gradient reductions) unless `--precision` says otherwise:

autopart           the plan `parallelize` chooses for the world, eager
autopart_compiled  the same plan with `compile=True` (inductor, each rank's program)
fsdp2_compiled     the torchtitan-style baseline: each decoder layer compiled
                   (`torch.compile`) and sharded with `fully_shard` under
                   `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`, the
                   root too; activation checkpointing of every layer where autopart's
                   plan recomputes (where memory needs it)

Each is timed over steps after warm-up (which compiles), in alternating rounds; the
report is tokens/s, MFU (torchtitan's count: 6·N·tokens plus 12·layers·width·seq per
token for attention, over the device's dense bf16 peak), peak device memory, and
autopart's tokens/s over the baseline's. One JSON line.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from harness import print_json_line
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import autopart

# Dense bf16 peaks from the data sheets (without sparsity), by device name.
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}

Step = Callable[[], float]


def _sizes(small: bool) -> dict:
    if small:
        return {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 256,
        }
    return {
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 18,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
    }


def _llama(small: bool, seq: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(**_sizes(small), max_position_embeddings=seq, use_cache=False)
    return LlamaForCausalLM(config)


def _loss(output, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.flatten(0, 1).float(), target.flatten())


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, fused=torch.cuda.is_available())


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _autopart(
    small: bool, ids, target, compile: bool, precision: str
) -> tuple[Step, Callable, dict]:
    pm = autopart.parallelize(
        _llama(small, ids.shape[1]),
        autopart.Mesh.local(),
        (ids,),
        loss_fn=_loss,
        optimizer=_adamw,
        precision=precision,
        compile=compile,
    )
    plan = pm.plan
    chosen = {"zero": plan.zero, "microbatches": plan.microbatches, "recompute": plan.recompute}
    return (lambda: pm.train_step(ids, target).item()), pm.close, chosen


def _fsdp2(small: bool, ids, target, checkpoint: bool) -> tuple[Step, Callable, dict]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = _device()
    model = _llama(small, ids.shape[1]).to(device)
    mesh = init_device_mesh(device.type, (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    layers = model.model.layers
    for i, layer in enumerate(list(layers)):
        block: nn.Module = checkpoint_wrapper(layer) if checkpoint else layer
        block = torch.compile(block)
        fully_shard(block, mesh=mesh, mp_policy=policy)
        layers[i] = block
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = _adamw(model.parameters())

    def step() -> float:
        loss = _loss(model(ids), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step, lambda: None, {"checkpoint": checkpoint}


def _flops_per_token(small: bool, seq: int) -> float:
    s = _sizes(small)
    model = _llama(small, seq)
    dense = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    return 6 * dense + 12 * s["num_hidden_layers"] * s["hidden_size"] * seq


def _peak() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def measure(
    small: bool, batch: int, seq: int, steps: int, rounds: int, precision: str = "bf16-params"
) -> dict:
    device = _device()
    vocab = _sizes(small)["vocab_size"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
    target = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
    # The baseline checkpoints where autopart's plan recomputes: where memory needs it.
    _, close, chosen = _autopart(small, ids, target, False, precision)
    close()
    checkpoint = bool(chosen["recompute"])
    builders: dict[str, Callable[[], tuple[Step, Callable, dict]]] = {
        "autopart": lambda: _autopart(small, ids, target, False, precision),
        "autopart_compiled": lambda: _autopart(small, ids, target, True, precision),
        "fsdp2_compiled": lambda: _fsdp2(small, ids, target, checkpoint),
    }
    times: dict[str, list[float]] = {k: [] for k in builders}
    memory: dict[str, float] = {}
    losses: dict[str, float] = {}
    warmup_s: dict[str, float] = {}
    for _ in range(rounds):
        for name, build in builders.items():
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            step, close, _ = build()
            began = time.perf_counter()
            for _ in range(2):  # warm-up, which compiles
                step()
            warmup_s.setdefault(name, round(time.perf_counter() - began, 1))
            start = time.perf_counter()
            for _ in range(steps):
                losses[name] = step()
            if device.type == "cuda":
                torch.cuda.synchronize()
                memory[name] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            times[name].append((time.perf_counter() - start) / steps)
            progress = {"step_s": round(times[name][-1], 4), "peak_gib": memory.get(name)}
            print(f"gpu_step: {name} {progress}", flush=True)  # kept if a later one fails
            close()
            del step, close
    tokens = batch * seq
    median = {k: statistics.median(v) for k, v in times.items()}
    rate = {k: tokens / v for k, v in median.items()}
    peak = _peak()
    per_token = _flops_per_token(small, seq)
    spread = {k: round((max(v) - min(v)) / statistics.median(v), 3) for k, v in times.items()}
    return {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "params_b": round(sum(p.numel() for p in _llama(small, seq).parameters()) / 1e9, 3),
        "batch": batch,
        "seq": seq,
        "autopart_plan": {k: str(v) for k, v in chosen.items()},
        "autopart_precision": precision,
        "tokens_per_s": {k: round(v, 1) for k, v in rate.items()},
        "mfu": {k: round(v * per_token / peak, 3) for k, v in rate.items()} if peak else None,
        "peak_gib": memory or None,
        "warmup_s": warmup_s,
        "spread": spread,
        "last_loss": {k: round(v, 4) for k, v in losses.items()},
        "autopart_vs_fsdp2": round(rate["autopart"] / rate["fsdp2_compiled"], 3),
        "compiled_vs_fsdp2": round(rate["autopart_compiled"] / rate["fsdp2_compiled"], 3),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--precision", default="bf16-params", help="autopart's precision")
    args = parser.parse_args(argv)
    autopart.Mesh.local()  # a world of 1: NCCL on a GPU, Gloo on a CPU
    batch = args.batch or (2 if args.small else 4)
    seq = args.seq or (32 if args.small else 2048)
    result = measure(args.small, batch, seq, args.steps, args.rounds, args.precision)
    print_json_line({"benchmark": "gpu_step", **result})
    return result


if __name__ == "__main__":
    main()
