"""Mixed precision: low-precision compute over fp32 master weights.

"bf16-mixed" and "fp16-mixed" run forward (and the loss) under `torch.autocast`, so
matrix products compute in the low dtype while parameters, gradients and optimizer
state stay fp32; gradients are therefore reduced in fp32. (With master weights on the
host the device's parameters and gradients are 16-bit copies instead: runtime/offload.py.
Under fp16 the scaled gradients are then fp16 too, and overflow, skipping a step and
halving the scale, until the scale has come down to what they hold.) fp16's narrow range also
needs loss scaling: the loss is multiplied before backward, the synchronized gradients
are divided back and checked for overflow on every rank (one all-reduce of a flag, so
all ranks skip the same steps), and the scale halves on overflow and doubles after a
run of clean steps.

"bf16-params" is no autocast: the model itself computes in bf16, its graph captured
over bf16 parameters and inputs, as FSDP2's `param_dtype` and Megatron-LM's `--bf16`
run it; the fp32 masters live with the optimizer (runtime/data_parallel.py,
runtime/zero.py). Its floating inputs are cast to bf16 on the way in, as FSDP2 casts
a root module's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from autopart.batch import floating_in
from autopart.policy import LOW_DTYPES, PARAM_DTYPES
from autopart.policy import Precision as PrecisionName


class Precision:
    def __init__(self, precision: str, device_type: str = "cpu") -> None:
        self.dtype = LOW_DTYPES.get(precision)
        self.param_dtype = PARAM_DTYPES.get(precision)
        self.device_type = device_type
        fp16 = precision == PrecisionName.FP16_MIXED
        self.scaler = LossScaler(collective_device=torch.device(device_type)) if fp16 else None

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        if self.dtype is None:
            yield
            return
        with torch.autocast(self.device_type, dtype=self.dtype):
            yield

    def model_inputs(self, inputs: Any) -> Any:
        """The model's inputs as its graph takes them: floating ones in the parameters'
        dtype under 16-bit parameters (the target stays as it is: the loss's)."""
        return inputs if self.param_dtype is None else floating_in(inputs, self.param_dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler else loss

    def unscale(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide the gradients back; False when some rank overflowed (skip the step)."""
        if self.scaler is None:
            return True
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return self.scaler.unscale(params)


class LossScaler:
    def __init__(
        self,
        initial: float = 2.0**16,
        growth_interval: int = 2000,
        backoff: float = 0.5,
        collective_device: torch.device | None = None,
    ) -> None:
        self.value = initial
        # Where the backend's collectives read from (a GPU under NCCL), which need not be
        # where the gradients are (the host, under offload).
        self.collective_device = collective_device or torch.device("cpu")
        self.growth_interval = growth_interval
        self.backoff = backoff
        self._clean_steps = 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.value

    def unscale(self, params: list[torch.nn.Parameter]) -> bool:
        grads = [p.grad for p in params if p.grad is not None]
        device = grads[0].device if grads else self.collective_device
        found_inf = torch.zeros(1, device=device)
        if grads:
            inverse = torch.full((1,), 1.0 / self.value, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inverse)
        if dist.is_initialized():
            found_inf = found_inf.to(self.collective_device)
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        finite = found_inf.item() == 0
        self._update(finite)
        if not finite:
            for p in params:
                p.grad = None
        return finite

    def _update(self, finite: bool) -> None:
        if not finite:
            self.value *= self.backoff
            self._clean_steps = 0
            return
        self._clean_steps += 1
        if self._clean_steps == self.growth_interval:
            self.value *= 2.0
            self._clean_steps = 0
