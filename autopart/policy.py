"""What the runtime does and the cost models price, defined once.

Each policy here is followed by the code that runs it and read by the model that
predicts it; both import it from here, so the two cannot drift apart.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, StrEnum

import torch

MiB = 1024**2


class Precision(StrEnum):
    """How a plan computes: fp32; autocast to 16 bits over fp32 weights ("-mixed"); or
    the model itself in bf16, its fp32 master weights held by the optimizer
    ("bf16-params": FSDP2's `param_dtype`, Megatron-LM's `--bf16`)."""

    FP32 = "fp32"
    BF16_MIXED = "bf16-mixed"
    FP16_MIXED = "fp16-mixed"
    BF16_PARAMS = "bf16-params"


class Schedule(StrEnum):
    """A pipeline schedule (torch.distributed.pipelining's)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved-1f1b"


class MasterWeights(StrEnum):
    """Where a mixed-precision plan's fp32 weights live: on the device (the parameters
    themselves, under autocast), or, with ZeRO offload, on the host beside the optimizer
    state, the device holding 16-bit copies of them."""

    DEVICE = "device"
    HOST = "host"


PRECISIONS: tuple[str, ...] = tuple(p.value for p in Precision)
# Spellings people reach for first, as pins: both mean autocast over fp32 weights.
PRECISION_ALIASES = {"bf16": Precision.BF16_MIXED.value, "fp16": Precision.FP16_MIXED.value}
# Precision pins that leave the choice among modes to the solver (`solver/pins.py`):
# each mode is planned where the pins allow it, and the first in this order is kept
# unless a later one's plan is faster by more than CHOICE_SLACK (autocast over fp32
# weights changes the math less than 16-bit parameters do).
PRECISION_CHOICES: dict[str, tuple[str, ...]] = {
    "bf16-auto": (Precision.BF16_MIXED.value, Precision.BF16_PARAMS.value),
}
SCHEDULES: tuple[str, ...] = tuple(s.value for s in Schedule)

# The 16-bit dtype autocast computes in, per mixed precision (runtime/precision.py).
LOW_DTYPES: dict[str, torch.dtype] = {
    Precision.BF16_MIXED.value: torch.bfloat16,
    Precision.FP16_MIXED.value: torch.float16,
}

# The dtype a 16-bit-parameter precision holds the model's parameters (and floating
# inputs) in: the graph is captured in it, and the optimizer steps fp32 masters.
PARAM_DTYPES: dict[str, torch.dtype] = {Precision.BF16_PARAMS.value: torch.bfloat16}


class ReduceDtype(StrEnum):
    """What a 16-bit-parameter plan reduces its data-parallel gradients in (FSDP2's
    `reduce_dtype`): fp32 by default, the 16-bit gradients widened first; or bf16."""

    FP32 = "fp32"
    BF16 = "bf16"


REDUCE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}

# The plan chosen is the simplest within this fraction of the fastest plan that fits
# (solver/search.py); `str(plan)` and `plan.explain()` state the rule beside the
# alternatives it left.
CHOICE_SLACK = 0.05
# How many of the other plans that fit a plan lists (`Plan.alternatives`), fastest
# first, one for each set of mechanisms switched on (solver/pins.py).
MAX_ALTERNATIVES = 4

# How long a collective waits for its peers before it fails the step (parallelize's
# `timeout`): NCCL's own default, bounded where Gloo's is half an hour.
COLLECTIVE_TIMEOUT_S = 600.0

# Data-parallel gradient buckets (runtime/grad_sync.py; ZeRO-1/2's flat shards in
# runtime/zero_replicas.py follow the same buckets). The first bucket of backward is
# small, so communication starts early.
GRAD_BUCKET_BYTES = 25 * MiB
FIRST_GRAD_BUCKET_BYTES = 1 * MiB

# ZeRO-3's parameter buckets (passes/zero.py): one per repeated block, runs of the
# parameters between blocks, each split at this cap.
ZERO3_BUCKET_BYTES = 128 * MiB
# A bucket read again after this many other buckets were gathered is gathered again.
ZERO3_REGATHER_AFTER = 2


# Optimizers whose update of each element reads only that element's gradient and state
# (besides scalars: the step, the learning rate). ZeRO steps the optimizer on flat shards
# of the parameters, which gives exactly what these do on whole tensors; an optimizer
# that reads a whole tensor (Adafactor's row and column statistics, LBFGS's line
# search over every parameter) would compute something else.
ELEMENTWISE_OPTIMIZERS: frozenset[type[torch.optim.Optimizer]] = frozenset(
    {
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adamax,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.Adagrad,
        torch.optim.Adadelta,
        torch.optim.RMSprop,
        torch.optim.Rprop,
        torch.optim.ASGD,
    }
)


def optimizer_class(
    factory: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
) -> type[torch.optim.Optimizer]:
    """The class of optimizer `factory` builds, from one built over a one-element
    parameter (cheap, and independent of the model)."""
    return type(factory([torch.nn.Parameter(torch.zeros(1))]))


def optimizer_refusal(optimizer: type[torch.optim.Optimizer] | None) -> str | None:
    """Why `train_step` cannot run `optimizer` at all; None when it can."""
    closure = inspect.signature(optimizer.step).parameters.get("closure") if optimizer else None
    if optimizer is None or closure is None or closure.default is not inspect.Parameter.empty:
        return None
    return (
        f"{optimizer.__name__}.step needs a closure that runs the model again, but "
        "train_step runs one forward and backward per step: use an optimizer whose step "
        "takes the gradients as they are (SGD, AdamW, ...)"
    )


def zero_refusal(zero: int, optimizer: type[torch.optim.Optimizer] | None) -> str | None:
    """Why ZeRO stage `zero` cannot run `optimizer` exactly; None when it can (or no
    optimizer is known). Stages 1 and 2 step whole parameters for an optimizer not known
    to be elementwise (runtime/zero_owners.py); ZeRO-3 shards the parameters themselves
    flat, which only an elementwise optimizer steps as on one device."""
    if zero < 3 or optimizer is None or optimizer in ELEMENTWISE_OPTIMIZERS:
        return None
    known = ", ".join(sorted(o.__name__ for o in ELEMENTWISE_OPTIMIZERS))
    return (
        f"ZeRO-3 shards every parameter flat, and the optimizer steps the shards: exact "
        f"only for elementwise optimizers ({known}); {optimizer.__name__} is not known to "
        "be one, so its updates would change. Use zero=1 or zero=2 (which step whole "
        "parameters for it), zero=0, or one of those optimizers"
    )


def check_choice(kind: type[Enum], value: object, what: str) -> str | None:
    """None if `value` names a member of `kind`, else the sentence that says what would."""
    names = _member_values(kind)
    if value in names:
        return None
    # A near miss ('1F1B', 'bf16_mixed') names the member it was meant to.
    nearest = difflib.get_close_matches(str(value).lower(), names, n=1)
    guess = f" (did you mean {nearest[0]!r}?)" if nearest else ""
    return f"{what} must be one of {names}, not {value!r}{guess}"


@functools.cache
def _member_values(kind: type[Enum]) -> list[str]:
    # The search checks its choices millions of times; an enum's members do not change.
    # Shared by every caller: read, never changed.
    return [m.value for m in kind]


POWERSGD = re.compile(r"powersgd:rank=([1-9]\d*)$")


def compression_refusal(spec: str | None) -> str | None:
    """Why `spec` is not a gradient compression autopart runs (`grad_compression`)."""
    if spec is None or spec == "bf16" or POWERSGD.match(spec):
        return None
    return f"grad_compression must be 'bf16' or 'powersgd:rank=R' (R ≥ 1), not {spec!r}"


def offload_refusal(zero: int, dp: int, cp: int, ep: int) -> str | None:
    """Why ZeRO offload cannot run on this layout, or None. The runtime steps host
    copies of ZeRO's shards (under ep, the experts' and the other weights' alike), or
    of one replica's whole state; cp sums gradients over a group of its own, which it
    does not offload, and so does ep without ZeRO."""
    if (zero == 0 and dp * ep > 1) or cp > 1:
        return (
            "offload moves the optimizer state to the host, ZeRO's shards of it or a "
            "single replica's whole: it needs zero=1, 2 or 3, or dp=ep=1, and no cp "
            f"(got zero={zero}, dp={dp}, cp={cp}, ep={ep})"
        )
    return None


def master_weights_refusal(master_weights: str, offload: bool, precision: str) -> str | None:
    """Why the fp32 master weights cannot live where asked, or None. On the host they
    are the offloaded optimizer's copies, and the device's copies are 16-bit: they need
    offload and a mixed precision, whose 16-bit dtype those copies take."""
    problem = check_choice(MasterWeights, master_weights, "master_weights")
    if problem or master_weights == MasterWeights.DEVICE:
        return problem
    if not offload or precision not in LOW_DTYPES:
        return (
            "master_weights='host' keeps the fp32 weights beside the offloaded optimizer "
            "state and 16-bit copies on the device: it needs offload=True and precision "
            f"'bf16-mixed' or 'fp16-mixed' (got offload={offload}, precision={precision!r})"
        )
    return None


def param_dtype_refusal(
    precision: str,
    reduce_dtype: str,
    dp: int,
    cp: int,
    zero: int,
    offload: bool,
    local_sgd: bool,
    compressed: bool,
) -> str | None:
    """Why a plan cannot hold its parameters in 16 bits as asked, or None. The fp32
    masters live with the optimizer: ZeRO's shards of them over data parallelism (as
    FSDP2 and Megatron-LM's distributed optimizer keep them), or one replica's whole.
    `dp`: the ranks that split the batch (dp × ep)."""
    problem = check_choice(ReduceDtype, reduce_dtype, "reduce_dtype")
    if problem:
        return problem
    if precision not in PARAM_DTYPES:
        if reduce_dtype != ReduceDtype.FP32:
            return (
                f"reduce_dtype={reduce_dtype!r} is for 16-bit parameters "
                f"(precision='bf16-params'); precision {precision!r} reduces fp32 gradients"
            )
        return None
    if dp > 1 and zero == 0:
        return (
            "precision='bf16-params' keeps the fp32 master weights with the optimizer, "
            "sharded over the data-parallel ranks: use zero=1, 2 or 3 (zero=1 moves the "
            "bytes zero=0 would, and holds 1/dp of the masters)"
        )
    if offload or local_sgd or compressed or cp > 1:
        return (
            "precision='bf16-params' does not combine with offload, local SGD, gradient "
            "compression or cp yet: use precision='bf16-mixed' for those"
        )
    return None


def replica_opt_in_refusal(
    zero: int, sync_every: int | None, grad_compression: str | None
) -> str | None:
    """Why local SGD (`sync_every`) or gradient compression cannot run as asked, or None.
    Both act on plain data parallelism's whole replicas, which ZeRO shards, and a
    compressed gradient all-reduce has nothing to compress under local SGD."""
    if sync_every is not None and sync_every < 1:
        return f"sync_every must be at least 1, not {sync_every}"
    if grad_compression is not None:
        refusal = compression_refusal(grad_compression)
        if refusal or zero or sync_every is not None:
            return refusal or (
                "grad_compression compresses plain data parallelism's gradient all-reduce: "
                "use zero=0 and no sync_every"
            )
    if sync_every is not None and zero:
        return (
            f"local SGD (sync_every={sync_every}) keeps a whole replica on every "
            f"data-parallel rank, which ZeRO-{zero} shards: use zero=0"
        )
    return None


@dataclass(frozen=True)
class OuterOptimizer:
    """Local SGD's outer optimizer (DiLoCo's form of federated averaging): at every
    averaging, the replicas' mean moves the parameters held since the last one by
    SGD on their difference, at this learning rate and momentum (Nesterov's, where
    asked). lr=1 without momentum is plain averaging."""

    lr: float = 1.0
    momentum: float = 0.0
    nesterov: bool = False


OUTER_SPEC = "'sgd:lr=L[,momentum=M][,nesterov]'"


def outer_optimizer(spec: str) -> OuterOptimizer:
    """The outer optimizer `spec` names: "sgd:lr=0.7,momentum=0.9,nesterov"."""
    kind, _, options = spec.partition(":")
    if kind != "sgd" or not options:
        raise ValueError(f"outer_optimizer must be {OUTER_SPEC}, not {spec!r}")
    values: dict[str, float] = {}
    nesterov = False
    for option in options.split(","):
        name, eq, value = option.strip().partition("=")
        if name == "nesterov" and not eq:
            nesterov = True
            continue
        try:
            values[name] = float(value)
        except ValueError:
            raise ValueError(f"outer_optimizer must be {OUTER_SPEC}, not {spec!r}") from None
        if name not in ("lr", "momentum"):
            raise ValueError(f"outer_optimizer must be {OUTER_SPEC}, not {spec!r}")
    if "lr" not in values or values["lr"] <= 0 or not 0 <= values.get("momentum", 0) < 1:
        raise ValueError(
            f"outer_optimizer {spec!r} needs lr > 0 and 0 ≤ momentum < 1 ({OUTER_SPEC})"
        )
    if nesterov and not values.get("momentum"):
        raise ValueError(f"outer_optimizer {spec!r}: Nesterov's momentum needs momentum > 0")
    return OuterOptimizer(values["lr"], values.get("momentum", 0.0), nesterov)


def outer_optimizer_refusal(spec: str | None, sync_every: int | None) -> str | None:
    """Why an outer optimizer cannot run as asked, or None."""
    if spec is None:
        return None
    try:  # the spec's form first: it is wrong whatever sync_every is
        outer_optimizer(spec)
    except ValueError as e:
        return str(e)
    if sync_every is None:
        return "outer_optimizer steps local SGD's averaged parameters: it needs sync_every=H"
    return None


def powersgd_rank(spec: str) -> int:
    """R of "powersgd:rank=R"."""
    found = POWERSGD.match(spec)
    if found is None:
        raise ValueError(compression_refusal(spec))
    return int(found.group(1))


def powersgd_matrix(shape: torch.Size) -> tuple[int, int]:
    """The matrix PowerSGD sees of a gradient: its first dim by the rest."""
    n = shape[0] if len(shape) else 1
    return n, shape.numel() // max(n, 1)


def powersgd_compresses(shape: torch.Size, rank: int) -> bool:
    """Whether PowerSGD at `rank` sends a gradient of `shape` as factors (a matrix whose
    smaller side is at least the rank); vectors and thinner matrices go whole."""
    return len(shape) >= 2 and rank <= min(powersgd_matrix(shape))


def sequence_multiple(cp: int, tp: int, sequence_parallel: bool) -> int:
    """What every sequence's length must be a multiple of: context parallelism cuts it
    into 2·cp chunks (`ops.context_parallel`'s mirrored layout), and sequence
    parallelism splits each rank's tokens over tp."""
    chunks = 2 * cp if cp > 1 else 1
    return chunks * (tp if sequence_parallel else 1)


def cp_gradients_in_sync(zero: int, sync_every: int | None, grad_compression: str | None) -> bool:
    """Whether the gradients each context-parallel rank holds a part of (its tokens')
    are summed over cp by the data-parallel sync, once per step, bucketed and
    overlapped with backward (plain data parallelism: ZeRO-0, exact, every step), rather
    than all-reduced over cp in backward as each is produced."""
    return zero == 0 and sync_every is None and grad_compression is None
