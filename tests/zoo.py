"""The model zoo: its models (tests/zoo_models.py, tests/zoo_media.py) and its cells,
one model under one set of pins trained 3 AdamW steps on a local Gloo world of 2 CPU
processes against the same model trained on one device. A cell is "pass" (losses and
parameters within 1e-4 relative of one device), "refused" (autopart raised a clear
error while capturing or planning: its first line is recorded) or "fail" (the numbers
differ, or any other exception). Every model has a cell under each pin but two: cp2
only where it attends, ep2 only where it is a mixture of experts (`pins_of`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import autopart
from autopart.runtime.faults import PeerLost
from autopart.testing import run_world
from tests import zoo_media as media
from tests import zoo_models as lm
from tests.models import assert_matches, make_optimizer, tiny_gpt2, tiny_t5, train_reference

WORLD = 2
STEPS = 3
RTOL = 1e-4
# One measure of float32's noise is one sample of it: a cell may lie this many times
# as far (`within_float32_noise`).
NOISE_FACTOR = 4
# A rank whose peer died mid-step fails its collective after this long (PeerLost)
# rather than holding the world until run_world's own 10-minute limit.
COLLECTIVE_TIMEOUT_S = 120

PINS: dict[str, dict[str, Any]] = {
    "dp2": {"dp": 2},
    "tp2": {"tp": 2},
    "zero3": {"dp": 2, "zero": 3},
    "pp2": {"pp": 2, "schedule": "1f1b", "microbatches": 2},
    "cp2": {"cp": 2},
    "ep2": {"ep": 2},
}


@dataclass(frozen=True)
class ZooCase:
    """One model: how to build it (seeded here, so every copy starts from the same
    weights), its global batch and its loss. Module-level functions only, since the
    case's name is all that crosses into the ranks' processes."""

    build: Callable[[], nn.Module]
    batch: Callable[[], lm.Batch]
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    family: str
    attends: bool = True  # has attention, over a sequence of tokens, patches or frames
    # Its float32 training is itself far from exact: 3 AdamW steps turn rounding into
    # steps of the learning rate's size where a gradient is near zero (BatchNorm over a
    # few values a channel, in depthwise networks). A cell is then held to float32's own
    # reproducibility where it is looser than RTOL (`float32_noise`).
    float32_noise: bool = False

    def model(self) -> nn.Module:
        torch.manual_seed(0)
        return self.build()

    def has_cell(self, pin_name: str) -> bool:
        """Whether the zoo runs this model under `pin_name`: context parallelism where
        it attends, expert parallelism where it routes tokens to experts."""
        if pin_name == "cp2":
            return self.attends
        if pin_name == "ep2":
            return self.family == "MoE decoder"
        return True


# What most models share: (batch, loss).
TOKENS = (lm.token_batch, lm.token_loss)
SEQ2SEQ = (lm.seq2seq_batch, lm.token_loss)
IMAGES = (media.image_batch, media.class_loss)

MODELS: dict[str, ZooCase] = {
    "gpt2": ZooCase(tiny_gpt2, *TOKENS, "decoder"),
    "llama": ZooCase(lm.llama, *TOKENS, "decoder"),
    "mistral": ZooCase(lm.mistral, *TOKENS, "decoder"),
    "qwen2": ZooCase(lm.qwen2, *TOKENS, "decoder"),
    "qwen3": ZooCase(lm.qwen3, *TOKENS, "decoder"),
    "phi3": ZooCase(lm.phi3, *TOKENS, "decoder"),
    "gemma": ZooCase(lm.gemma, *TOKENS, "decoder"),
    "gpt_neox": ZooCase(lm.gpt_neox, *TOKENS, "decoder"),
    "opt": ZooCase(lm.opt, *TOKENS, "decoder"),
    "falcon": ZooCase(lm.falcon, *TOKENS, "decoder"),
    "mixtral": ZooCase(lm.mixtral, *TOKENS, "MoE decoder"),
    "qwen2_moe": ZooCase(lm.qwen2_moe, *TOKENS, "MoE decoder"),
    "olmoe": ZooCase(lm.olmoe, *TOKENS, "MoE decoder"),
    "bert": ZooCase(lm.bert, *TOKENS, "encoder"),
    "distilbert": ZooCase(lm.distilbert, *TOKENS, "encoder"),
    "deberta_v2": ZooCase(lm.deberta_v2, *TOKENS, "encoder"),
    "t5": ZooCase(tiny_t5, *SEQ2SEQ, "encoder-decoder"),
    "bart": ZooCase(lm.bart, *SEQ2SEQ, "encoder-decoder"),
    "nn_transformer": ZooCase(lm.torch_transformer, *SEQ2SEQ, "encoder-decoder"),
    "vit": ZooCase(media.vit, *IMAGES, "vision"),
    "swin": ZooCase(media.swin, *IMAGES, "vision"),
    "convnext": ZooCase(media.convnext, *IMAGES, "vision", attends=False),
    "cnn_batchnorm": ZooCase(media.ConvBNNet, *IMAGES, "vision", attends=False),
    "resnet": ZooCase(media.resnet, *IMAGES, "vision", attends=False),
    "mobilenet_v2": ZooCase(
        media.mobilenet_v2, *IMAGES, "vision", attends=False, float32_noise=True
    ),
    "efficientnet": ZooCase(
        media.efficientnet, *IMAGES, "vision", attends=False, float32_noise=True
    ),
    "whisper": ZooCase(media.whisper, media.speech_seq2seq_batch, lm.token_loss, "speech"),
    "wav2vec2": ZooCase(media.wav2vec2, media.audio_batch, lm.token_loss, "speech"),
    "clip": ZooCase(media.clip, media.image_text_batch, media.contrastive_loss, "image-text"),
    "two_tower": ZooCase(
        media.TwoTower, media.image_text_batch, media.contrastive_loss, "image-text", attends=False
    ),
    "llama_varargs": ZooCase(lm.llama_varargs, *TOKENS, "wrapper"),
    "llama_dict_output": ZooCase(lm.llama_dict_output, *TOKENS, "wrapper"),
}


Verdict = dict[str, Any]  # {"status": "pass" | "refused" | "fail", "reason"?: str, ...}


def pins_of(model_name: str, pin_names: list[str] | None = None) -> list[str]:
    """The pins of `pin_names` (every pin by default) under which the zoo runs a model."""
    case = MODELS[model_name]
    return [p for p in (list(PINS) if pin_names is None else pin_names) if case.has_cell(p)]


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
    """One cell on this rank: {"losses", "params"}, or {"refused"} when capture or
    planning refuses, or {"error"} for anything else. (Timing belongs to the benchmark,
    which measures capture itself.)"""
    inputs, target = case.batch()
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
    try:
        losses = [pm.train_step(inputs, target).item() for _ in range(STEPS)]
        result = {"losses": losses, "params": pm.full_state_dict()}
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
    """The model trained on one device, on the whole global batch; for a model with
    `float32_noise`, with how far float32 alone moves that run ("noise")."""
    case = MODELS[model_name]
    inputs, target = case.batch()
    want = train_reference(case.model(), "adamw", STEPS, inputs, target, case.loss_fn)
    if case.float32_noise:
        want["noise"] = float32_noise(case, want)
    return want


def float32_noise(case: ZooCase, want: dict[str, Any]) -> dict[str, Any]:
    """How far one device's float32 run (`want`) lies from itself, per loss and tensor:
    the largest of its distances from the float64 run, from the float32 run on the batch
    in another order (the sums taken in another order, as a split takes them), and from
    the float32 run on PyTorch's own CPU kernels instead of oneDNN's (another kernel's
    rounding, as a replica's smaller batch may be given another kernel)."""
    inputs, target = case.batch()
    order = torch.randperm(len(target), generator=torch.Generator().manual_seed(0))
    wide = tuple(x.double() if x.is_floating_point() else x for x in inputs)
    runs = [
        train_reference(case.model().double(), "adamw", STEPS, wide, target, case.loss_fn),
        train_reference(
            case.model(),
            "adamw",
            STEPS,
            tuple(x[order] for x in inputs),
            target[order],
            case.loss_fn,
        ),
    ]
    # oneDNN off, its other flags (TF32, which warns on a CPU) left as they are.
    with torch.backends.mkldnn.flags(False, None, None, None):
        runs.append(train_reference(case.model(), "adamw", STEPS, inputs, target, case.loss_fn))
    return {
        "losses": [
            max(abs(w - r["losses"][i]) for r in runs) for i, w in enumerate(want["losses"])
        ],
        "params": {
            k: max((v.double() - r["params"][k].double()).norm().item() for r in runs)
            for k, v in want["params"].items()
        },
    }


def within_float32_noise(result: dict[str, Any], want: dict[str, Any]) -> None:
    """`assert_matches` at RTOL, each loss and tensor allowed NOISE_FACTOR times
    float32's own distance (`float32_noise`) where that is larger."""
    noise = want["noise"]
    for step, (got, ref) in enumerate(zip(result["losses"], want["losses"], strict=True)):
        bound = max(RTOL * abs(ref), NOISE_FACTOR * noise["losses"][step])
        assert abs(got - ref) <= bound, f"step {step}: loss {got} != {ref}"
    for name, ref in want["params"].items():
        err, norm = (result["params"][name] - ref).norm().item(), ref.norm().item()
        bound = max(10 * RTOL * norm, NOISE_FACTOR * noise["params"][name])
        assert err <= bound, f"{name}: error {err:.2e} beyond {bound:.2e}"


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


def verdict(per_rank: list[dict[str, Any]], want: dict[str, Any]) -> Verdict:
    """A cell's verdict over its ranks: the first error, else a refusal, else whether
    every rank's numbers match one device."""
    for key, status in (("error", "fail"), ("refused", "refused")):
        if reasons := [r[key] for r in per_rank if key in r]:
            return {"status": status, "reason": reasons[0]}
    record: dict[str, Any] = {}
    if not all(math.isfinite(v) for r in per_rank for v in r["losses"]):
        return {"status": "fail", "reason": "non-finite loss", **record}
    record["loss_rel_diff"] = float(f"{loss_difference(per_rank, want):.2e}")
    for rank, result in enumerate(per_rank):
        try:
            if "noise" in want:
                within_float32_noise(result, want)
            else:
                assert_matches(result, want, rtol=RTOL)
        except AssertionError as e:
            return {"status": "fail", "reason": f"rank {rank}: {e}", **record}
    return {"status": "pass", **record}


def judge_model(model_name: str, pin_names: list[str]) -> dict[str, Verdict]:
    """Each pin's verdict for one model, its cells run in one world (one start-up of
    the ranks); a world that crashes is run again pin by pin, so that the crash is
    charged to its own cell."""
    try:
        want = reference(model_name)
    except Exception as e:  # the model does not even train on one device
        return {p: {"status": "fail", "reason": "reference: " + first_line(e)} for p in pin_names}
    try:
        per_rank = run_world(train_cells, WORLD, model_name, pin_names)
    except RuntimeError as e:
        if len(pin_names) == 1:
            return {pin_names[0]: {"status": "fail", "reason": "crashed: " + crash_line(e)}}
        return {p: judge_model(model_name, [p])[p] for p in pin_names}
    return {p: verdict([r[i] for r in per_rank], want) for i, p in enumerate(pin_names)}
