"""The models people bring: tiny Hugging Face architectures and ordinary wrappers,
each captured, planned and trained under several pins on a local Gloo world of 2 CPU
processes, against the same model trained on one device.

    python benchmarks/model_zoo.py [--models llama,t5] [--pins dp2,pp2]

Every model is built from a tiny config (random weights, nothing downloaded; 2 layers,
so every model can cut into 2 pipeline stages). Each (model, pins) cell trains 3 AdamW
steps and is one of: "pass" (losses and parameters within 1e-4 relative of one device),
"refused" (autopart raised a clear error while capturing or planning: its first line is
recorded), or "fail" (the numbers differ, or any other exception). Prints one JSON line
per cell, a table of models × pins, and a JSON line with the counts.
"""

from __future__ import annotations

import argparse
import collections
import math
import pathlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # for `tests`

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from harness import print_json_line  # noqa: E402
from torch import nn  # noqa: E402

import autopart  # noqa: E402
from autopart.runtime.faults import PeerLost  # noqa: E402
from autopart.testing import run_world  # noqa: E402
from tests.models import (  # noqa: E402
    assert_matches,
    make_optimizer,
    tiny_gpt2,
    tiny_llama,
    tiny_t5,
    train_reference,
)

VOCAB = 128
SEQ = 16
BATCH = 8
STEPS = 3
RTOL = 1e-4
# A rank whose peer died mid-step fails its collective after this long (PeerLost)
# rather than holding the world until run_world's own 10-minute limit.
COLLECTIVE_TIMEOUT_S = 120

PINS: dict[str, dict[str, Any]] = {
    "dp2": {"dp": 2},
    "tp2": {"tp": 2},
    "zero3": {"dp": 2, "zero": 3},
    "pp2": {"pp": 2, "schedule": "1f1b", "microbatches": 2},
}


# -- the models -------------------------------------------------------------------------


def _decoder_sizes() -> dict[str, Any]:
    """The sizes every tiny decoder shares (Llama's config names, which most follow)."""
    return {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "use_cache": False,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,  # a padding row in the embedding, as released checkpoints have
    }


def llama() -> nn.Module:
    return tiny_llama(pad_token_id=0)  # a padding row, as released checkpoints have


def mistral() -> nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(**_decoder_sizes(), sliding_window=8))


def qwen2() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**_decoder_sizes()))


def phi3() -> nn.Module:
    from transformers import Phi3Config, Phi3ForCausalLM

    # Phi-3 fuses q/k/v and gate/up into one weight each.
    config = Phi3Config(**_decoder_sizes(), resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)
    return Phi3ForCausalLM(config)


def gemma() -> nn.Module:
    from transformers import GemmaConfig, GemmaForCausalLM

    # Gemma's default head_dim is 256, far wider than this model's hidden size.
    return GemmaForCausalLM(GemmaConfig(**_decoder_sizes(), head_dim=16))


def mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**_decoder_sizes(), num_local_experts=4, num_experts_per_tok=2)
    return MixtralForCausalLM(config)


def key_biases_off_zero(model: nn.Module) -> nn.Module:
    """Start the attention key biases from small random values instead of zeros. With
    absolute positions (no rotary embedding) softmax ignores a constant added to every
    key, so a key bias's true gradient is exactly zero and its fp32 gradient is rounding
    noise that Adam turns into updates of random sign: a zero-initialized key bias ends
    at ~1e-8, all noise, and no two summation orders agree on it. Started off zero, its
    comparison is about the distributed arithmetic again."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("key.bias", "k_proj.bias")):
                param.normal_(0.0, 0.02)
    return model


def bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return key_biases_off_zero(BertForMaskedLM(config))


def vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=32,
        patch_size=8,
        num_channels=3,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        num_labels=10,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return key_biases_off_zero(ViTForImageClassification(config))


class Varargs(nn.Module):
    """A `forward(self, *args)` adapter, a common way to fit a model to a training loop."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: torch.Tensor):
        return self.model(*args)


def llama_varargs() -> nn.Module:
    return Varargs(llama())


class DictOutput(nn.Module):
    """A model returning a dict of outputs rather than a tensor or a ModelOutput."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.model(ids, output_hidden_states=True)
        return {"logits": out.logits, "hidden": out.hidden_states[-1]}


def llama_dict_output() -> nn.Module:
    return DictOutput(llama())


# -- inputs and losses ------------------------------------------------------------------


def _tokens(*shape: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def token_batch() -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    return (_tokens(BATCH, SEQ, seed=1),), _tokens(BATCH, SEQ, seed=2)


def seq2seq_batch() -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    # A decoder half as long as the encoder: the two sequences need not agree.
    ids, decoder_ids = _tokens(BATCH, SEQ, seed=1), _tokens(BATCH, SEQ // 2, seed=2)
    return (ids, decoder_ids), _tokens(BATCH, SEQ // 2, seed=3)


def image_batch() -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    pixels = torch.randn(BATCH, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    return (pixels,), torch.randint(0, 10, (BATCH,), generator=torch.Generator().manual_seed(2))


def token_loss(output, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every position's logits (an LM's, a masked LM's, a decoder's)."""
    logits = output["logits"] if isinstance(output, dict) else output.logits
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def class_loss(output, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits, target)


@dataclass(frozen=True)
class ZooCase:
    """One model: how to build it (seeded here, so every copy starts from the same
    weights), its global batch and its loss. Module-level functions only, since the
    case's name is all that crosses into the spawned ranks."""

    build: Callable[[], nn.Module]
    batch: Callable[[], tuple[tuple[torch.Tensor, ...], torch.Tensor]]
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]

    def model(self) -> nn.Module:
        torch.manual_seed(0)
        return self.build()


MODELS: dict[str, ZooCase] = {
    "gpt2": ZooCase(tiny_gpt2, token_batch, token_loss),
    "llama": ZooCase(llama, token_batch, token_loss),
    "mistral": ZooCase(mistral, token_batch, token_loss),
    "qwen2": ZooCase(qwen2, token_batch, token_loss),
    "phi3": ZooCase(phi3, token_batch, token_loss),
    "gemma": ZooCase(gemma, token_batch, token_loss),
    "mixtral": ZooCase(mixtral, token_batch, token_loss),
    "bert": ZooCase(bert, token_batch, token_loss),
    "vit": ZooCase(vit, image_batch, class_loss),
    "t5": ZooCase(tiny_t5, seq2seq_batch, token_loss),
    "llama_varargs": ZooCase(llama_varargs, token_batch, token_loss),
    "llama_dict_output": ZooCase(llama_dict_output, token_batch, token_loss),
}


# -- on every rank ----------------------------------------------------------------------


def first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def is_refusal(e: Exception) -> bool:
    """A clear refusal: autopart's own errors (PlanError, NoPlanFits, CaptureError, ...)
    and the ValueErrors it raises for pins it cannot honour. A lost peer is a crash."""
    own = type(e).__module__.startswith("autopart")
    return not isinstance(e, PeerLost) and (own or isinstance(e, ValueError))


def train_cell(case: ZooCase, pins: dict[str, Any]) -> dict[str, Any]:
    """One cell on this rank: {"losses", "params", "seconds"}, or {"refused"} when
    capture or planning refuses, or {"error"} for anything else."""
    inputs, target = case.batch()
    start = time.perf_counter()
    try:
        pm = autopart.parallelize(
            case.model(),
            autopart.Mesh.local(),
            inputs,
            loss_fn=case.loss_fn,
            optimizer=make_optimizer("adamw"),
            timeout=COLLECTIVE_TIMEOUT_S,
            **pins,
        )
    except Exception as e:
        return {"refused" if is_refusal(e) else "error": "parallelize: " + first_line(e)}
    seconds = time.perf_counter() - start
    try:
        losses = [pm.train_step(inputs, target).item() for _ in range(STEPS)]
        result = {"losses": losses, "params": pm.full_state_dict(), "seconds": seconds}
    except Exception as e:
        result = {"error": "train_step: " + first_line(e)}
    pm.close()
    return result


def train_cells(model_name: str, pin_names: list[str]) -> list[dict[str, Any]]:
    """Every cell of one model on this rank. The barrier keeps the ranks in step after
    a cell that failed on one of them only."""
    out = []
    for pin_name in pin_names:
        out.append(train_cell(MODELS[model_name], PINS[pin_name]))
        dist.barrier()
    return out


# -- in the parent ----------------------------------------------------------------------


def reference(model_name: str) -> dict[str, Any]:
    """The model trained on one device, on the whole global batch."""
    case = MODELS[model_name]
    inputs, target = case.batch()
    return train_reference(case.model(), "adamw", STEPS, inputs, target, case.loss_fn)


def crash_line(e: RuntimeError) -> str:
    """The exception line of the first rank's traceback in run_world's error."""
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    ends = [ln for ln in lines if not ln.startswith((" ", "Traceback", "distributed run"))]
    return (ends[0] if ends else lines[-1])[:300]


def loss_difference(results: list[dict[str, Any]], want: dict[str, Any]) -> float:
    return max(
        abs(got - ref) / abs(ref)
        for r in results
        for got, ref in zip(r["losses"], want["losses"], strict=True)
    )


def verdict(per_rank: list[dict[str, Any]], want: dict[str, Any]) -> dict[str, Any]:
    """A cell's verdict over its ranks: the first error, else a refusal, else whether
    every rank's numbers match one device."""
    for key, status in (("error", "fail"), ("refused", "refused")):
        if reasons := [r[key] for r in per_rank if key in r]:
            return {"status": status, "reason": reasons[0]}
    record: dict[str, Any] = {"seconds_to_parallelize": round(per_rank[0]["seconds"], 1)}
    if not all(math.isfinite(v) for r in per_rank for v in r["losses"]):
        return {"status": "fail", "reason": "non-finite loss", **record}
    record["loss_rel_diff"] = float(f"{loss_difference(per_rank, want):.2e}")
    for rank, result in enumerate(per_rank):
        try:
            assert_matches(result, want, rtol=RTOL)
        except AssertionError as e:
            return {"status": "fail", "reason": f"rank {rank}: {e}", **record}
    return {"status": "pass", **record}


def judge_model(model_name: str, pin_names: list[str]) -> dict[str, dict[str, Any]]:
    """Each pin's verdict for one model, its cells run in one world (one start-up of
    the ranks); a world that crashes is run again pin by pin, so that the crash is
    charged to its own cell."""
    try:
        want = reference(model_name)
    except Exception as e:  # the model does not even train on one device
        return {p: {"status": "fail", "reason": "reference: " + first_line(e)} for p in pin_names}
    try:
        per_rank = run_world(train_cells, 2, model_name, pin_names)
    except RuntimeError as e:
        if len(pin_names) == 1:
            return {pin_names[0]: {"status": "fail", "reason": "crashed: " + crash_line(e)}}
        return {p: judge_model(model_name, [p])[p] for p in pin_names}
    return {p: verdict([r[i] for r in per_rank], want) for i, p in enumerate(pin_names)}


def print_table(verdicts: dict[str, dict[str, dict[str, Any]]], pin_names: list[str]) -> None:
    width = max(len(m) for m in verdicts) + 2
    print("model".ljust(width) + "".join(p.ljust(9) for p in pin_names), flush=True)
    for model_name, cells in verdicts.items():
        row = "".join(cells[p]["status"].ljust(9) for p in pin_names)
        print(model_name.ljust(width) + row, flush=True)


def subset(option: str, known: dict[str, Any], what: str) -> list[str]:
    names = option.split(",") if option else list(known)
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise SystemExit(f"unknown {what} {unknown}; known: {', '.join(known)}")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="", help="comma-separated, default all")
    parser.add_argument("--pins", default="", help="comma-separated, default all")
    args = parser.parse_args()
    model_names = subset(args.models, MODELS, "models")
    pin_names = subset(args.pins, PINS, "pins")
    verdicts = {}
    for model_name in model_names:
        verdicts[model_name] = judge_model(model_name, pin_names)
        for pin_name, cell in verdicts[model_name].items():
            record = {"model": model_name, "pins": pin_name, "pin_values": PINS[pin_name]}
            print_json_line({"benchmark": "model_zoo", **record, **cell})
    print_table(verdicts, pin_names)
    counts = collections.Counter(c["status"] for cells in verdicts.values() for c in cells.values())
    print_json_line(
        {
            "benchmark": "model_zoo",
            "cases": sum(counts.values()),
            "pass": counts["pass"],
            "refused": counts["refused"],
            "fail": counts["fail"],
        }
    )


if __name__ == "__main__":
    main()
