"""What mixed precision does to the bytes of a graph captured in fp32.

Mixed-precision training here is `torch.autocast` over fp32 parameters (the master
weights). Autocast runs contractions (matmuls, attention, convolutions) in bf16 / fp16
and every other operator in the widest dtype of its inputs, so the norms, the
elementwise operators and the residual stream of a model whose embedding is fp32 stay
fp32. Under "bf16-mixed" / "fp16-mixed" therefore:

    a contraction reads, writes and saves for backward half its captured bytes, and
      first converts its fp32 operands (parameters and activations read) to 16-bit: a
      cast kernel that reads 4 and writes 2 bytes per element, 1.5× the captured bytes;
    every other operator moves and saves what it was captured with.

Checked on an H100 SXM (PyTorch 2.11), forward + backward of Hugging Face Llama models
on 4 × 2048 tokens against `ComputeModel` with the h100-80g preset: under bf16 autocast
0.85 × the measured time (hidden 2048, 8 layers) and 0.94 × (hidden 4096, 2 layers); in
fp32 0.98 × and 1.01 ×. The kernels other than matmuls and attention (fp32 elementwise,
casts, gradient accumulation) took more than half the bf16 step; halving every
operator's bytes instead predicted 0.63 ×.

A model built in 16 bits (its parameters and activations captured in fp16 or bf16, as
Megatron-LM and its descendants train a 16-bit model over fp32 main weights held by
the optimizer) has nothing for autocast to cast: its contractions move and save the
bytes they were captured with, and pay no cast (`NodeWork.low_precision`). That is
how "bf16-params" runs any model: captured over bf16 parameters and inputs.
"""

from __future__ import annotations

from autopart.cost_models.work import NodeWork
from autopart.policy import PRECISIONS, Precision, check_choice

CAST_FACTOR = 1.5  # bytes a cast moves per captured fp32 byte: read 4, write 2


def is_mixed(precision: str) -> bool:
    """Whether the plan autocasts a graph captured wider than 16 bits. Not under
    "bf16-params", whose graph is captured in bf16: it moves what it was captured with."""
    if precision not in PRECISIONS:  # the fast test first: this runs per operator
        raise ValueError(check_choice(Precision, precision, "precision"))
    return precision in (Precision.BF16_MIXED, Precision.FP16_MIXED)


def bytes_scale(work: NodeWork, precision: str) -> float:
    """Bytes an operator moves and saves, as a fraction of the captured ones:
    1/2 for a contraction captured in fp32 under mixed precision, 1 otherwise."""
    return 0.5 if autocasts(work, precision) else 1.0


def autocasts(work: NodeWork, precision: str) -> bool:
    """Whether autocast converts this operator's operands to 16 bits: a contraction
    captured wider than 16 bits, under mixed precision."""
    return is_mixed(precision) and work.is_contraction and not work.low_precision


def cast_bytes(work: NodeWork, precision: str) -> float:
    """Bytes autocast's conversion of a contraction's fp32 operands moves:
    1.5 × (parameters + activations read); 0 in fp32, for other operators and for
    operands already in 16 bits."""
    if not autocasts(work, precision):
        return 0.0
    return CAST_FACTOR * (work.param_bytes + work.read_bytes)
