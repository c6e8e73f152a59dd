"""Memory of one rank: model states by ZeRO stage, activations by schedule, buffers and an
allocator allowance.

Model states (Rajbhandari et al., "ZeRO", 2020, section 3.1). For Ψ parameters trained
with Adam, a rank holds parameters, gradients and K·Ψ bytes of optimizer state:

    layout                          parameters  gradients  optimizer (K)
    fp32 weights (autopart's)       4Ψ          4Ψ         8Ψ   (two fp32 moments)
    16-bit weights (the paper's)    2Ψ          2Ψ         12Ψ  (fp32 master + two moments)

ZeRO shards them over the N data-parallel ranks:

    DP      (2 + 2 + K)Ψ           ZeRO-2  2Ψ + (2 + K)Ψ/N
    ZeRO-1  (2 + 2)Ψ + KΨ/N        ZeRO-3  (2 + 2 + K)Ψ/N

(the 2s being 4s with fp32 weights). The paper's example, 7.5B parameters on 64 ranks
with 16-bit weights, gives 120 / 31.4 / 16.6 / 1.9 GB. autopart's runtime keeps fp32
weights and gradients in every precision (mixed precision is autocast: only the compute
is 16-bit), so its total is the same 16Ψ but ZeRO-1/2 shard a different share of it;
only with the master weights on the host (offloaded, beside K) does the device hold
the paper's 16-bit weights and gradients (`state_bytes`).

Activations. A microbatch leaves the bytes its operators save for backward
(`passes.saved`) on the rank until its backward runs; the schedule decides how many
microbatches are in flight (`in_flight_microbatches`). Recomputing a block keeps only
its input per microbatch; in backward one block at a time is recomputed, so the largest
recomputed block's saved bytes are live once more:

    activations = in_flight · (kept + Σ recomputed block inputs) + max recomputed block

The largest recomputed block's bytes are live in backward only after the loss's output
gradients (below) are freed, so on the rank that computes the loss only the larger of
the two counts (`predict._rank_cost`).

Output gradients. Backward starts with every activation of the last microbatch still
saved and the loss's gradient flowing into the model's output. A loss over the output
(a softmax cross-entropy, for a language model over the vocabulary) holds two gradients
the size of the output at once there, its own and the log-softmax's: 2 × the output's
bytes, on the rank that runs the last pipeline stage. At a large vocabulary this is the
logits spike (8 × 2048 tokens over a 128K vocabulary in fp32: 2 × 8.4 GB).

Buffers. Gradients live in the flat communication buckets (`runtime.grad_sync`), so
plain data parallelism needs nothing more. ZeRO-1/2 stage one bucket for the
reduce-scatter (at most all the gradients); ZeRO-3 also holds the gathered parameters
of two blocks (the one running and the one prefetched): all of a recomputed block's,
which its recomputation reads at once and backward gathers together, a bucket at a
time of the others' (`ops/zero3.py`). That gather is the one backward takes anyway,
so recomputation adds no third. A pipeline stage holds one activation to send and
one received.

Allocator. PyTorch's caching allocator rounds blocks up and fragments; 5-15% of the
allocated bytes is typical. The allowance is `allocator_fraction` (10%) of the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopart.policy import (
    FIRST_GRAD_BUCKET_BYTES,
    GRAD_BUCKET_BYTES,
    MasterWeights,
    Precision,
    Schedule,
)

# Bytes per parameter: (parameters, gradients, optimizer state) for Adam.
FP32_WEIGHTS = (4, 4, 8)
HALF_WEIGHTS = (2, 2, 12)
# 16-bit parameters: the fp32 masters join the optimizer state; the gradients the
# optimizer reads are fp32 (the masters'), the 16-bit ones transient in the buckets.
SIXTEEN_BIT_PARAMS = (2, 4, 12)
# autopart keeps fp32 weights, gradients and optimizer state under autocast (but for
# master weights on the host: `state_bytes`).
STATE_BYTES: dict[str, tuple[int, int, int]] = {
    **{p: FP32_WEIGHTS for p in Precision},
    Precision.BF16_PARAMS: SIXTEEN_BIT_PARAMS,
}


def state_bytes(precision: str, master_weights: str = MasterWeights.DEVICE) -> tuple[int, int, int]:
    """Bytes per parameter of its (weights, gradients, optimizer state) as autopart's
    runtime holds them: fp32 under every precision, but for master weights on the host,
    where the device's weights and gradients are 16-bit and the fp32 masters join the
    (offloaded) optimizer state."""
    return HALF_WEIGHTS if master_weights == MasterWeights.HOST else STATE_BYTES[precision]


PARTS = (
    "parameters",
    "gradients",
    "optimizer",
    "activations",
    "output_gradients",
    "buffers",
    "allocator",
)
OUTPUT_GRADIENTS = 2  # output-sized gradients the loss's backward holds at once
DEFAULT_ALLOCATOR_FRACTION = 0.10


def model_state_bytes(
    params: float, dp: int, zero: int, per_param: tuple[int, int, int], offload: bool = False
) -> dict[str, float]:
    """Parameters, gradients and Adam state of `params` parameters on one of `dp`
    data-parallel ranks at ZeRO stage `zero` (0-3), with `per_param` bytes of each
    (`STATE_BYTES[precision]` for autopart's runtime); the state in host memory, not
    the device's, where `offload`."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, not {zero}")
    param_bytes, per_grad, per_state = per_param
    return {
        "parameters": params * param_bytes / (dp if zero >= 3 else 1),
        "gradients": params * per_grad / (dp if zero >= 2 else 1),
        "optimizer": 0.0 if offload else params * per_state / (dp if zero >= 1 else 1),
    }


def sharded_state_bytes(
    params: float,
    experts: float,
    dp: int,
    ep: int,
    zero: int,
    per_param: tuple[int, int, int],
    offload: bool = False,
) -> dict[str, float]:
    """`model_state_bytes` of a rank holding `params` parameters, `experts` of them
    expert weights split over ep: ZeRO shards the experts over their dp replicas and
    the other weights over dp × ep (`runtime/zero.py`)."""
    rest = model_state_bytes(params - experts, dp * ep, zero, per_param, offload)
    own = model_state_bytes(experts, dp, zero, per_param, offload)
    return {part: rest[part] + own[part] for part in rest}


def in_flight_microbatches(
    schedule: str | None, microbatches: int, stages: int, stage: int, virtual_stages: int = 1
) -> float:
    """Microbatches whose activations a pipeline rank holds at once, in units of the
    rank's whole share of the model.

    No pipeline (schedule None): 1, microbatches run one after another.
    GPipe: all m forwards run before any backward.
    1F1B: rank s (0-based) runs p − s forwards before its first backward: min(m, p − s).
    Interleaved 1F1B (Megatron-LM's schedule): rank s warms up with
    2(p − s − 1) + (v − 1)·p chunk-forwards and then holds one more, each chunk being
    1/v of its layers: min(m·v, 2(p − s − 1) + (v − 1)·p + 1) / v.
    """
    if schedule is None or stages == 1:
        return 1.0
    if schedule == Schedule.GPIPE:
        return float(microbatches)
    if schedule == Schedule.ONE_F_ONE_B:
        return float(min(microbatches, stages - stage))
    if schedule == Schedule.INTERLEAVED_1F1B:
        v = virtual_stages
        chunks = min(microbatches * v, 2 * (stages - stage - 1) + (v - 1) * stages + 1)
        return chunks / v
    raise ValueError(f"unknown schedule {schedule!r}")


@dataclass(frozen=True, slots=True)
class Activations:
    """Per-microbatch saved bytes of one rank, split by recomputation."""

    kept: float = 0.0  # saved by operators that are not recomputed
    recomputed_inputs: float = 0.0  # the inputs of recomputed blocks, summed
    largest_recomputed: float = 0.0  # saved bytes of the largest recomputed block

    def bytes(self, in_flight: float) -> float:
        """in_flight · (kept + Σ recomputed inputs) + max recomputed block."""
        return in_flight * (self.kept + self.recomputed_inputs) + self.largest_recomputed


@dataclass(frozen=True, slots=True)
class MemoryModel:
    """Per-rank memory at a precision, with Adam, a bucket size and an allocator
    allowance."""

    precision: str = "fp32"
    bucket_bytes: float = GRAD_BUCKET_BYTES
    first_bucket_bytes: float = FIRST_GRAD_BUCKET_BYTES
    allocator_fraction: float = DEFAULT_ALLOCATOR_FRACTION

    def breakdown(
        self,
        params: float,
        dp: int = 1,
        zero: int = 0,
        activations: float = 0.0,
        gathered_params: float = 0.0,
        pipeline_bytes: float = 0.0,
        output_bytes: float = 0.0,
        offload: bool = False,
        experts: float = 0.0,
        ep: int = 1,
        master_weights: str = MasterWeights.DEVICE,
    ) -> dict[str, int]:
        """Bytes by part for a rank holding `params` parameters (its tensor-parallel
        share; `experts` of them its 1/ep of the expert weights), `activations` bytes of
        activations, ZeRO-3 blocks of up to `gathered_params` parameters, pipeline
        transfers of `pipeline_bytes` and, where it computes the loss, a model output of
        `output_bytes` per microbatch; `master_weights` as `state_bytes` takes it."""
        per_param = state_bytes(self.precision, master_weights)
        parts = sharded_state_bytes(params, experts, dp, ep, zero, per_param, offload)
        parts["activations"] = activations
        parts["output_gradients"] = OUTPUT_GRADIENTS * output_bytes
        parts["buffers"] = self.buffer_bytes(
            params, dp * ep, zero, gathered_params, pipeline_bytes, per_param
        )
        parts["allocator"] = self.allocator_fraction * sum(parts.values())
        return {name: round(parts[name]) for name in PARTS}

    def buffer_bytes(
        self,
        params: float,
        dp: int,
        zero: int,
        gathered_params: float,
        pipeline_bytes: float,
        per_param_state: tuple[int, int, int],
    ) -> float:
        """A reduce-scatter bucket (ZeRO ≥ 1), two blocks of gathered parameters
        (ZeRO-3), one activation sent and one received (pipelines); `per_param_state`
        as `state_bytes` gives it."""
        per_param, per_grad, _ = per_param_state
        buffers = 2 * pipeline_bytes
        if dp > 1 and zero >= 1:
            buffers += min(self.bucket_bytes, params * per_grad)
        if dp > 1 and zero == 3:
            buffers += 2 * gathered_params * per_param
        return buffers


def total(breakdown: dict[str, int]) -> int:
    return sum(breakdown.values())
