"""How long operators take on one device: a roofline per operator.

    time = max(FLOPs / (peak(dtype) · efficiency), bytes / memory bandwidth) + launch

`launch` is `DeviceSpec.kernel_launch_s`, paid by every operator the dispatcher runs,
views and other metadata-only operators included (not by Python-level nodes such as a
tuple's item: `work.HOST_ONLY`). On a CPU an operator's dispatch (the Python call, the
dispatcher, autograd's recording, allocating the output) is serial work on the same
core as its arithmetic, and for the small operators of a training step the larger part
of their time: on a 2-core x86 host a view costs 2-5 µs forward and as much again in
backward, a graph operator of a transformer about 9 µs on average (what `autopart
calibrate` measures as the floor). On a GPU a view launches no kernel and its host
dispatch overlaps the kernels already queued, so there the floor overstates views by a
few µs each, nothing beside large kernels.

Peak. Contractions (matmuls, attention, convolutions) run at the peak of the compute
dtype: fp32 for "fp32", bf16 / fp16 for "bf16-mixed" / "fp16-mixed" (tensor cores).
Every other operator runs on the vector units at the fp32 peak; those are almost always
memory-bound, where the peak does not matter.

Efficiency of a contraction, on a GPU preset (`DeviceSpec.sm_count` set), comes from
its shape (`gemm.py`): the matmul's output tiles in waves over the SMs, or the fused
attention kernel's query blocks, by key length and head dim. A matmul's backward is
priced as its own two products, (m, k, n) for the input's gradient and (k, n, m) for
the weight's, each with its own tiles. Elsewhere (CPUs, calibrated profiles) it is a
saturating curve of the smallest dim d = min(m, n, k):

    efficiency(m, n, k) = matmul_efficiency · d / (d + d½)

`matmul_efficiency` (DeviceSpec) is the fraction of peak large matmuls reach; d½ is the
dim at which a matmul reaches half of that. Small and skinny matmuls fill few tiles and
waves of the device and run far below peak; the bytes term of the roofline covers the
ones that become memory-bound. For attention d is the head dim.

Layouts. A calibrated profile carries a curve (peak, d½) for each of a linear layer's
three products per dtype (`DeviceSpec.matmul_products`, `LINEAR_PRODUCTS`): its forward
x @ Wᵀ reads the weight transposed, its input gradient g @ W reads both operands as
stored, its weight gradient gᵀ @ x reads the first transposed. A library may run them
at very different rates: where a CPU lacks 16-bit instructions, ATen's bf16 product
with both operands as stored runs several times slower than with one transposed. Each
matrix product is priced as the products it runs (`LAYOUT_PRODUCTS`, by the layout of
its forward, `NodeWork.layout`), forward and backward on their own curves. Other
contractions, and profiles without these curves, take `peak_flops` and d½ as above.

Attention on a CPU. A calibrated CPU profile carries fused attention's measured cost per
dtype, causal and full, forward and backward (`DeviceSpec.attention_rates`): seconds per
query row of each head plus seconds per FLOP, fitted over a few shapes. ATen's CPU
kernel computes in blocks of query rows, and in bf16 its backward costs far more per
row than in fp32; the measured cost includes its exponentials (`function_time` then
adds none).

The curve was fitted on an H100 SXM 80GB (PyTorch 2.11, CUDA 13, bf16): with
matmul_efficiency 0.75 and d½ = 64 the roofline predicts the 18 measured matmul shapes
that run for 100 µs or more (m, n, k from 16 to 16384) within −12% / +7%, where any d½
up to 128 fits about as well; and flash attention forward + backward (head dim 64 and
128) within 11% at sequence length 2048 and 4096, the fit that decides d½. Shorter
sequences run slower than modelled (1.3× at 1024, 1.8× at 512; the shape model's key
length term, `gemm.py`, follows them). `autopart calibrate` fits d½ for the local device
(`calibrate.fit_matmul_curve`).

Precision (`precision`). The graph is captured in fp32. Under "bf16-mixed" /
"fp16-mixed" (torch.autocast) contractions move half the captured bytes and pay a cast
of their fp32 operands (one more kernel, 1.5× the operands' captured bytes); other
operators run in fp32 as captured.

Transcendentals. A pointwise function such as tanh or exp (and attention's exp of every
score) can cost more in arithmetic than in memory traffic where the device evaluates it
in software: on a CPU, tens of cycles an element. A profile from `autopart calibrate`
carries each function's measured rate (`DeviceSpec.function_rates`, evaluations per
second), and the operator's arithmetic time gains evaluations / rate. The data-sheet
presets carry none: a GPU's special-function units keep these operators memory-bound.

Backward and recomputation. A contraction's backward computes two products of the same
size as its forward (the input gradient and the weight gradient): 2× the forward's
FLOPs, bytes and kernels. Every other operator's backward is taken as 1× its forward (an
elementwise gradient reads and writes about what the forward did; a view's gradient is
one more view or reshape; a few run more, `work.BACKWARD_PASSES`), without the function's
evaluations unless the gradient evaluates it again (`work.FUNCTION_IN_BACKWARD`;
attention recomputes its probabilities).
Recomputing an operator in backward costs one more forward.

Scale. A calibrated profile carries `DeviceSpec.compute_scale`: the measured over the
modeled time of a reference transformer layer's forward and backward (`autopart
calibrate`), what running operators one after another costs beyond each one's roofline.
Every operator's time is multiplied by it (1.0 for the data-sheet presets).

Optimizer. Adam's update is memory-bound. torch's implementations (the single-tensor
one and the multi-tensor "foreach" one alike) run it as eight elementwise operators,
each reading its operands and writing its result through memory, as an unfused kernel
does (`passes/traffic.py`): the weight decay and the update read and write the weights,
the two moments' updates read the gradient (the second one twice, for its square),
the first moment is read and written by its update and read by the step, the second is
read and written by its decay and again by its update and read for its square root,
and the square root, its quotient and its sum each write a temporary the next reads.
That is 21 passes of a parameter's size, over the 4 such tensors of its state:
`ADAM_TRAFFIC` × the state's bytes. It also dispatches
`ADAM_OPERATORS_PER_TENSOR` operators per parameter tensor, as torch's single-tensor
implementation does (its default on CPU: the step counter, weight decay, the two moment
updates, the bias-corrected denominator in three operators, the update and the step's
`.item()`), each priced at the operator floor; a calibrated profile measures the
per-tensor cost itself (`DeviceSpec.optimizer_tensor_s`), right after a backward as
training runs the step: on a CPU the backward has evicted the state and the step's code
from the caches, which doubles the per-tensor cost of a warm step. On CUDA
torch defaults to the multi-tensor ("foreach") implementation,
which launches about as many kernels per group of tensors; there the per-tensor term
overstates a step by 10 launches per tensor (12 ms for Llama-3-8B's 291 tensors on an
H100, against a memory-bound update of about 200 ms).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from torch import fx

from autopart.cost_models.fusion import COMPILED_FLOOR, REGION_FLOORS, TENSOR_FLOORS
from autopart.cost_models.gemm import GpuCores
from autopart.cost_models.precision import bytes_scale, cast_bytes, is_mixed
from autopart.cost_models.work import ATTENTION, NodeWork, node_work
from autopart.mesh import DeviceSpec
from autopart.policy import Precision

DEFAULT_HALF_DIM = 64.0
BACKWARD_CONTRACTION = 2.0  # backward / forward for matmuls, attention, convolutions
BACKWARD_OTHER = 1.0  # backward / forward for everything else
ADAM_OPERATORS_PER_TENSOR = 10  # torch.optim.adam._single_tensor_adam, AdamW included
ADAM_TRAFFIC = 21 / 4  # Adam's bytes moved over its state's bytes (module docstring)
# A linear layer's three products (y = x @ Wᵀ), each timed by `autopart calibrate` in
# its own operand layout (`DeviceSpec.matmul_products`): forward x @ Wᵀ (the second
# operand transposed), grad_input g @ W (both as stored), grad_weight gᵀ @ x (the first
# transposed).
LINEAR_PRODUCTS = ("forward", "grad_input", "grad_weight")
# A matrix product's forward, its first operand's gradient and its second's, as the
# linear's products whose layouts they run in, by the forward's layout
# (`NodeWork.layout`): C = A @ Bᵀ runs as a linear does; C = A @ B runs its forward as a
# linear's grad_input, A's gradient G @ Bᵀ as its forward, B's gradient Aᵀ @ G as its
# grad_weight.
LAYOUT_PRODUCTS: dict[str, tuple[str, str, str]] = {
    "nt": ("forward", "grad_input", "grad_weight"),
    "nn": ("grad_input", "forward", "grad_weight"),
}
COMPUTE_DTYPES: dict[str, str] = {
    Precision.FP32: "fp32",
    Precision.BF16_MIXED: "bf16",
    Precision.FP16_MIXED: "fp16",
    Precision.BF16_PARAMS: "bf16",
}


@dataclass(frozen=True, slots=True)
class PhaseCost:
    """A cost (seconds or FLOPs) split by phase of the training step."""

    forward: float = 0.0
    backward: float = 0.0
    recompute: float = 0.0

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.recompute

    def __add__(self, other: PhaseCost) -> PhaseCost:
        return PhaseCost(
            self.forward + other.forward,
            self.backward + other.backward,
            self.recompute + other.recompute,
        )

    def __mul__(self, factor: float) -> PhaseCost:
        return PhaseCost(self.forward * factor, self.backward * factor, self.recompute * factor)


class ComputeModel:
    """Roofline times of operators on `device` at `precision`, run eagerly or, where
    `compiled`, in programs compiled by inductor (`fusion.py`)."""

    def __init__(
        self,
        device: DeviceSpec,
        precision: str = "fp32",
        half_dim: float = DEFAULT_HALF_DIM,
        compiled: bool = False,
    ) -> None:
        is_mixed(precision)  # fails on an unknown precision
        self.device = device
        self.precision = precision
        self.half_dim = half_dim
        self.compiled = compiled
        # The floor of an operator's dispatch, or of a compiled kernel's or library call's.
        self.launch = device.kernel_launch_s * (COMPILED_FLOOR if compiled else 1.0)
        self.contraction_peak = device.flops_for(COMPUTE_DTYPES[precision])
        # The calibrated curves of the compute dtype's products and attention, if any.
        self.products = device.matmul_products.get(COMPUTE_DTYPES[precision], {})
        self.attention = device.attention_rates.get(COMPUTE_DTYPES[precision], {})
        self.vector_peak = device.flops_for("fp32")
        self.scale = device.compute_scale
        # A GPU preset prices contractions by shape (gemm.py); the search asks for the
        # same shapes for every plan it prices, so their times are kept.
        self.cores = (
            GpuCores(
                device.sm_count,
                self.contraction_peak,
                device.matmul_efficiency,
                device.attention_efficiency,
                device.memory_bandwidth,
            )
            if device.sm_count
            else None
        )
        # (kind, shape, FLOPs, causal, backward) -> seconds of the shape model
        self._math: dict[tuple[str, tuple[float, float, float], float, bool, bool], float] = {}
        # (id of a tuple of operators, recompute) -> the tuple and its cost: a segment's
        # operators are one tuple for every plan priced at its sizes.
        self._costs: dict[tuple[int, bool], tuple[tuple[NodeWork, ...], PhaseCost]] = {}

    # -- one operator -----------------------------------------------------------------

    def efficiency(self, m: float, n: float, k: float) -> float:
        """The fraction of peak an m×k by k×n product reaches: by tiles and waves on a
        GPU preset, matmul_efficiency · d / (d + d½), d = min(m, n, k), elsewhere."""
        if self.cores is not None:
            return self.cores.gemm_efficiency(m, n, k)
        d = min(m, n, k)
        return self.device.matmul_efficiency * d / (d + self.half_dim)

    def contraction_math(self, work: NodeWork, backward: bool = False) -> float:
        """Seconds of a contraction's arithmetic: its forward, or its backward's (2× the
        FLOPs: for a matmul the products (m, k, n) and (k, n, m))."""
        if self.cores is None or work.shape is None:
            measured = self._measured_math(work, backward)
            if measured is not None:
                return measured
            eff = self.efficiency(*work.shape) if work.shape else self.device.matmul_efficiency
            return work.flops / (self.contraction_peak * eff) * (2 if backward else 1)
        key = (work.kind, work.shape, work.flops, work.causal, backward)
        if key not in self._math:
            self._math[key] = self._shaped_math(work, backward)
        return self._math[key]

    def _measured_math(self, work: NodeWork, backward: bool) -> float | None:
        """Seconds of a contraction's arithmetic from the profile's measurements of its
        kind, where it has them: a matrix product's products on their layouts' curves
        (`LAYOUT_PRODUCTS`), fused attention by its rows and FLOPs (module docstring)."""
        if work.shape is None:
            return None
        if work.kind == ATTENTION:
            fit = self._attention_fit(work, backward)
            if fit is None:
                return None
            _, keys, head = work.shape
            rows = work.flops / (4 * keys * head)  # batch × heads × queries
            return rows * fit["row_s"] + work.flops * (2 if backward else 1) * fit["flop_s"]
        products = LAYOUT_PRODUCTS.get(work.layout or "")
        if products is None or not all(p in self.products for p in products):
            return None
        forward, grad_first, grad_second = products
        runs = (grad_first, grad_second) if backward else (forward,)
        d = min(work.shape)
        seconds = 0.0
        for product in runs:
            fit = self.products[product]
            efficiency = self.device.matmul_efficiency * d / (d + fit["half_dim"])
            seconds += work.flops / (fit["peak"] * efficiency)
        return seconds

    def _measures_whole(self, work: NodeWork) -> bool:
        """Whether the profile's measurement prices this attention whole."""
        return self.cores is None and work.shape is not None and bool(self._attention_fit(work))

    def _attention_fit(self, work: NodeWork, backward: bool = False) -> Mapping[str, float] | None:
        """The profile's measured attention of this kind and direction, if any."""
        by_mask = self.attention.get("causal" if work.causal else "full", {})
        return by_mask.get("backward" if backward else "forward")

    def _shaped_math(self, work: NodeWork, backward: bool) -> float:
        assert self.cores is not None and work.shape is not None
        if work.kind == ATTENTION:
            queries, keys, head = work.shape
            forward = self.cores.attention_seconds(work.flops, queries, keys, head, work.causal)
            return forward * (BACKWARD_CONTRACTION if backward else 1)
        m, n, k = work.shape
        slowdown = self.cores.alignment_factor(n, k)
        if backward:
            return slowdown * (self.cores.gemm_seconds(m, k, n) + self.cores.gemm_seconds(k, n, m))
        return slowdown * self.cores.gemm_seconds(m, n, k)

    def forward_time(self, work: NodeWork, functions: bool = True) -> float:
        """The roofline time of one operator's forward, with its launch floor, plus the
        cast of its operands under mixed precision. `functions`: with the evaluations of
        its transcendental function (`function_time`)."""
        if not work.dispatched:
            return 0.0
        math = self.contraction_math(work) if work.is_contraction else work.flops / self.vector_peak
        if functions:
            math += self.function_time(work)
        if self.compiled and work.fusible:
            return self._fused(work, math)
        return self._kernel(work, math, passes=1)

    def _fused(self, work: NodeWork, math: float) -> float:
        """An operator of a fused kernel in a compiled program: its arithmetic, or the
        bytes it moves to and from memory (`NodeWork.fused_bytes`), and the kernel's
        floor where it writes its result (ending the kernel)."""
        memory = work.fused_bytes * bytes_scale(work, self.precision) / self.device.memory_bandwidth
        return self._launched(max(math, memory), self.launch if work.fused_written_bytes else 0.0)

    def backward_time(self, work: NodeWork) -> float:
        """A contraction's backward: its two products (`contraction_math`), twice the
        forward's bytes, kernels and casts. Any other operator's: its forward again,
        `NodeWork.backward_passes` times (without the function's evaluations, but for a
        fused operator of a compiled program, which backward recomputes: `fusion.py`)."""
        if not work.is_contraction:
            recomputed = self.compiled and work.fusible
            passes = BACKWARD_OTHER * work.backward_passes
            return self.forward_time(work, functions=recomputed) * passes
        if not work.dispatched:
            return 0.0
        return self._kernel(work, self.contraction_math(work, backward=True), BACKWARD_CONTRACTION)

    def _kernel(self, work: NodeWork, math: float, passes: float) -> float:
        """max(math, memory) and its launch, plus autocast's cast of the operands, for
        `passes` times the forward's bytes and kernels."""
        bandwidth, launch = self.device.memory_bandwidth, self.launch
        memory = passes * work.bytes * bytes_scale(work, self.precision) / bandwidth
        cast = cast_bytes(work, self.precision)
        seconds = self._launched(max(math, memory), passes * launch)
        if cast:
            seconds += self._launched(passes * cast / bandwidth, passes * launch)
        return seconds

    def _launched(self, seconds: float, launches: float) -> float:
        """A kernel's time with its launches. On a GPU (a shape-model preset) the host
        enqueues kernels ahead of the device, so a launch hides behind the kernels
        running unless the kernel is shorter than it; on a CPU the operator's dispatch
        is serial work on the same core as its arithmetic."""
        return max(seconds, launches) if self.cores is not None else seconds + launches

    def region_time(self, regions: int = 1, tensors: float = 0.0) -> PhaseCost:
        """What calling `regions` compiled regions that take `tensors` parameter tensors
        costs beyond their kernels, forward and backward (`fusion.REGION_FLOORS`,
        `fusion.TENSOR_FLOORS`); nothing eager, nor on a GPU preset, where the host's
        work hides behind the kernels it queued, as their launches do (`_launched`)."""
        if not self.compiled or not regions or self.cores is not None:
            return PhaseCost()  # eager; or on a GPU, host work behind the queued kernels
        floors = REGION_FLOORS * regions + TENSOR_FLOORS * tensors
        seconds = floors * self.device.kernel_launch_s * self.scale
        return PhaseCost(seconds, seconds)

    def function_time(self, work: NodeWork) -> float:
        """Evaluations of a transcendental over the device's measured rate for it
        (`DeviceSpec.function_rates`; none measured: the roofline alone); none for an
        attention whose measured time includes them (`_measured_math`)."""
        if work.kind == ATTENTION and self._measures_whole(work):
            return 0.0
        rate = self.device.function_rates.get(work.function) if work.function else None
        return work.evaluations / rate if rate else 0.0

    def time(self, work: NodeWork, recompute: bool = False) -> PhaseCost:
        """Forward, backward (2× for contractions, 1× otherwise, the function's
        evaluations once more where the gradient evaluates it) and recomputation."""
        forward = self.forward_time(work)
        backward = self.backward_time(work)
        if work.evaluates_in_backward and not (self.compiled and work.fusible):
            backward += self.function_time(work)
        return PhaseCost(forward, backward, forward if recompute else 0.0) * self.scale

    # -- many operators ---------------------------------------------------------------

    def cost(self, works: Iterable[NodeWork], recompute: bool = False) -> PhaseCost:
        """Seconds for a set of operators (a segment, a stage); kept for a tuple (the
        tuple too, so that its id is not reused)."""
        if isinstance(works, tuple):
            key = (id(works), recompute)
            kept = self._costs.get(key)
            if kept is None or kept[0] is not works:
                kept = self._costs[key] = (works, self._summed(works, recompute))
            return kept[1]
        return self._summed(works, recompute)

    def _summed(self, works: Iterable[NodeWork], recompute: bool) -> PhaseCost:
        total = PhaseCost()
        for work in works:
            total = total + self.time(work, recompute)
        return total

    def nodes_cost(
        self,
        gm: fx.GraphModule,
        dims: Mapping[str, int],
        nodes: Iterable[fx.Node] | None = None,
        recompute: bool = False,
    ) -> PhaseCost:
        """Seconds for `nodes` of an analyzed graph (all of them by default) on one
        microbatch of the sizes `dims` ({"batch": ..., "seq": ...})."""
        param_bytes = {k: p.numel() * p.element_size() for k, p in gm.named_parameters()}
        chosen = gm.graph.nodes if nodes is None else nodes
        return self.cost((node_work(n, gm, dims, param_bytes) for n in chosen), recompute)

    def optimizer_step_time(self, state_bytes: float, tensors: float = 0.0) -> float:
        """Adam over `tensors` parameter tensors holding `state_bytes` of parameters,
        gradients and state: `ADAM_TRAFFIC` × the bytes over the memory bandwidth, plus
        the per-tensor cost: measured, or `ADAM_OPERATORS_PER_TENSOR` launch floors
        (module docstring)."""
        per_tensor = self.device.optimizer_tensor_s
        if per_tensor is None:
            per_tensor = ADAM_OPERATORS_PER_TENSOR * self.device.kernel_launch_s
        return ADAM_TRAFFIC * state_bytes / self.device.memory_bandwidth + tensors * per_tensor


def backward_factor(work: NodeWork) -> float:
    return BACKWARD_CONTRACTION if work.is_contraction else BACKWARD_OTHER


def training_flops(works: Iterable[NodeWork], recompute: bool = False) -> PhaseCost:
    """FLOPs of forward, backward (2× for contractions, 1× otherwise) and recomputation
    (one more forward) of a set of operators."""
    total = PhaseCost()
    for w in works:
        total = total + PhaseCost(w.flops, w.flops * backward_factor(w), w.flops * recompute)
    return total
