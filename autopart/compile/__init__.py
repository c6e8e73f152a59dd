"""The torch.compile backend, under an unchanged training loop:

    torch.compile(model, backend="autopart")                       # data parallelism
    torch.compile(model, backend=autopart.backend(mesh, tp=2, zero=3))

Dynamo hands over each captured graph with the model's parameters among its inputs.
The backend analyzes the graph (FLOPs, memory, parameters; logged) and, inside a
torch.distributed world of more than one process:

- averages the gradients over the data-parallel replicas during backward, as
  DistributedDataParallel does; each process feeds its own share of the batch, and the
  ranks of one tensor-parallel group the same share;
- with `tp` > 1, plans the graph's tensor-parallel layout with autopart's solver and
  runs this rank's rewritten program (compile/tensor_parallel.py); a graph that cannot
  be planned (a piece cut off by a graph break, for instance) runs data-parallel, with
  one warning that names the break;
- with `zero` 1, 2 or 3, shards the optimizer state, the gradients and the parameters
  by whole parameters over the world (compile/zero.py), so that the user's own
  optimizer, built on `model.parameters()`, steps only what this rank owns.

Each graph, rewritten or not, is then handed to inductor (`compile_fx`, what
`backend="inductor"` runs), so compiling with autopart gives at least what the default
backend gives; `autopart.backend(mesh, inductor=False)` runs the graphs eagerly instead.
A ZeRO-3 graph stays eager: its gathers on use and its saved-tensor hooks are Python
that AOTAutograd would trace away.

The loop stays `loss.backward(); optimizer.step()`. Pipelines, recomputation and mixed
precision rewrite the training step itself: they go through `autopart.parallelize`.

Collectives run inside the graph only if every rank runs the same graph: ranks whose
data sends them down different branches would sum the gradients of different
parameters, silently (DistributedDataParallel hangs or raises). So before each forward
that communicates, the ranks compare the graph they are about to run, and the ranks of
a tensor-parallel group their inputs, and all of them raise together if any differs.
"""

from __future__ import annotations

import atexit
import functools
import gc
import hashlib
import logging
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from autopart.capture import from_graph_module
from autopart.compile.tensor_parallel import TensorParallelGraph, plan_tensor_parallel
from autopart.compile.zero import ParameterGradients, clip_grad_norm_, gather_on_use, gathered
from autopart.degrees import Axis, Degrees
from autopart.mesh import Mesh
from autopart.ops.groups import MeshGroups
from autopart.passes import analyze, total_flops
from autopart.plan import PlanError
from autopart.policy import COLLECTIVE_TIMEOUT_S
from autopart.runtime.compiled import inductor
from autopart.runtime.host_memory import keep_freed_memory

log = logging.getLogger("autopart.compile")

__all__ = [
    "AutopartBackend",
    "autopart_backend",
    "backend",
    "clip_grad_norm_",
    "gathered",
    "release_compiled_graphs",
]

_PINS = ("dp", "tp", "zero")


def release_compiled_graphs() -> None:
    """Drop dynamo's compiled graphs, and the process groups and pending work they hold,
    and collect them. Run at exit (registered by the backend's first compile), while the
    interpreter is whole: left to the interpreter's teardown, a Gloo worker thread still
    holding a tensor aborts the process after a correct run, so a script that ends with
    `dist.destroy_process_group()` alone, as DDP's do, could exit with an abort."""
    torch._dynamo.reset()
    gc.collect()


@functools.cache
def _release_compiled_graphs_at_exit() -> None:
    # Once a process. Handlers run last-registered first: before torch's own.
    atexit.register(release_compiled_graphs)


class AutopartBackend:
    """A dynamo backend for one mesh and its pins. One instance keeps the gradient syncs
    it attached, so a graph compiled again (a recompilation) does not hook the same
    parameters twice."""

    def __init__(
        self,
        mesh: Mesh | None = None,
        *,
        timeout: float | timedelta = COLLECTIVE_TIMEOUT_S,
        inductor: bool = True,
        **pins: Any,
    ) -> None:
        unknown = sorted(set(pins) - set(_PINS))
        if unknown:
            raise TypeError(
                f"autopart.backend pins {', '.join(_PINS)}, not {unknown}: pipelines, "
                "recomputation and mixed precision change the training step itself, "
                "so they go through autopart.parallelize"
            )
        zero = pins.get("zero") or 0
        if zero not in (0, 1, 2, 3):
            raise PlanError(f"zero is 0, 1, 2 or 3, not {zero!r}")
        self.mesh, self.zero, self.tp = mesh, zero, pins.get("tp") or 1
        self.dp = pins.get("dp")
        self.inductor = inductor
        self.timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
        self._groups: MeshGroups | None = None
        self._synced: dict[tuple[int, ...], ParameterGradients] = {}
        self._step_hooks: list[Any] = []
        self._graphs = 0

    def __repr__(self) -> str:
        pins = {"dp": self.dp, "tp": self.tp if self.tp > 1 else None, "zero": self.zero or None}
        return "autopart.backend(" + ", ".join(f"{k}={v}" for k, v in pins.items() if v) + ")"

    def __call__(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], **_: Any
    ) -> Callable[..., Any]:
        _release_compiled_graphs_at_exit()
        captured = from_graph_module(gm, tuple(example_inputs))
        analyze(captured.gm, captured.context())
        log.info(
            "autopart: graph of %d nodes, %s forward FLOPs",
            len(gm.graph.nodes),
            total_flops(captured.gm),
        )
        if not (
            any(isinstance(x, nn.Parameter) for x in example_inputs)
            and dist.is_initialized()
            and dist.get_world_size() > 1
        ):
            return self._compiled(gm, example_inputs)
        self._graphs += 1
        program = self._tensor_parallel(gm, example_inputs) if self.tp > 1 else None
        if program is None:
            graph = gm
            slots = zip(gm.graph.find_nodes(op="placeholder"), example_inputs)
            param_inputs = [(n, x) for n, x in slots if isinstance(x, nn.Parameter)]
        else:
            graph = program.program
            param_inputs = list(zip(program.parameter_inputs, program.params))
        params = list({id(p): p for _, p in param_inputs}.values())
        # Inputs follow first use in forward; backward runs the other way.
        sync = self._sync_for(list(reversed(params)))
        run: Callable[..., Any]
        if sync.storage is not None:
            gather_on_use(graph, [node for node, _ in param_inputs], sync.storage)
            run = program or graph.forward  # after the edit: recompiling replaces `forward`
        elif program is not None:
            run = program.compiled_by(self._compiled, example_inputs) if self.inductor else program
        else:
            run = self._compiled(graph, example_inputs)
        return _CompiledGraph(
            run,
            _signature(gm),
            sync,
            params[0].device,
            communicates=program is not None or self.zero == 3,
            tp_group=self.groups.group(Axis.TP) if program is not None else None,
        )

    def _compiled(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        """`gm` compiled by inductor, as the default backend compiles it (or its eager
        `forward`, with `inductor=False`)."""
        if not self.inductor:
            return gm.forward
        return inductor(gm, example_inputs)  # logs each graph's compile time

    def _tensor_parallel(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any]
    ) -> TensorParallelGraph | None:
        """This rank's tensor-parallel program of `gm`, or None (and a warning naming
        the graph break and the reason) if it cannot be planned."""
        pins = {"dp": self.degrees["dp"], "tp": self.tp, "zero": self.zero}
        try:
            return plan_tensor_parallel(gm, example_inputs, self.local_mesh, self.groups, pins)
        except Exception as e:  # any failure to plan falls back, never crashes the loop
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            warnings.warn(
                f"autopart: graph {self._graphs} of the compiled model{_after_break()} "
                f"cannot be planned for tp={self.tp} ({reason}); it runs data-parallel "
                f"over all {dist.get_world_size()} ranks",
                stacklevel=2,
            )
            return None

    @property
    def local_mesh(self) -> Mesh:
        if self.mesh is None:
            self.mesh = Mesh.local()
        return self.mesh

    @property
    def degrees(self) -> Degrees:
        """dp × tp over the world: the data each process feeds fixes them."""
        world = dist.get_world_size()
        dp = self.dp if self.dp is not None else world // self.tp
        if dp * self.tp != world:
            raise PlanError(
                f"dp={dp} × tp={self.tp} does not cover the world of {world} processes: "
                f"pin a tp that divides {world}"
            )
        return Degrees(dp=dp, tp=self.tp)

    @property
    def groups(self) -> MeshGroups:
        if self._groups is None:
            mesh = self.local_mesh
            device_mesh = mesh.device_mesh(self.degrees, self.timeout)
            self._groups = MeshGroups(device_mesh, mesh.group_options(self.timeout))
            if self._groups.device_type == "cpu":
                keep_freed_memory()  # as parallelize's runtime (runtime/host_memory.py)
        return self._groups

    def _sync_for(self, params: list[nn.Parameter]) -> ParameterGradients:
        key = tuple(id(p) for p in params)
        if key not in self._synced:
            world = dist.group.WORLD
            assert world is not None, "only called once torch.distributed is initialized"
            self._synced[key] = ParameterGradients(params, world, self.zero)
            if self.zero and not self._step_hooks:
                self._step_hooks = [
                    register_optimizer_step_pre_hook(self._before_step),
                    register_optimizer_step_post_hook(self._after_step),
                ]
        return self._synced[key]

    def _before_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        for sync, stepped in self._stepped(optimizer):
            sync.before_step(stepped)

    def _after_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        for sync, stepped in self._stepped(optimizer):
            sync.after_step(stepped)

    def _stepped(
        self, optimizer: torch.optim.Optimizer
    ) -> list[tuple[ParameterGradients, list[nn.Parameter]]]:
        """For each sync, the parameters of it that `optimizer` steps."""
        held = [p for group in optimizer.param_groups for p in group["params"]]
        out = []
        for sync in self._synced.values():
            ids = {id(p) for p in sync.params}
            stepped = [p for p in held if id(p) in ids]
            if stepped:
                out.append((sync, stepped))
        return out


class _CompiledGraph:
    """What dynamo calls in place of a graph: the checks, the gradient sync's start,
    and the program, under ZeRO-3's saved-tensor handles."""

    def __init__(
        self,
        run: Callable[..., Any],
        signature: int,
        sync: ParameterGradients,
        device: torch.device,
        communicates: bool,
        tp_group: dist.ProcessGroup | None,
    ) -> None:
        self.run, self.signature, self.sync, self.device = run, signature, sync, device
        self.communicates, self.tp_group = communicates, tp_group

    @torch._dynamo.disable  # runs the program as it is; dynamo already captured it
    def __call__(self, *args: Any) -> Any:
        training = torch.is_grad_enabled()
        if training or self.communicates:
            _check_same_graph(self.signature, self.device)
        if self.tp_group is not None:
            _check_same_inputs(args, self.tp_group, self.device)
        if training:
            self.sync.begin()
        if self.sync.storage is None:
            return self.run(*args)
        with self.sync.storage.saving():
            return self.run(*args)


def _after_break() -> str:
    """ " (after the graph break: <reason>)" for the latest break dynamo recorded."""
    from torch._dynamo.utils import counters  # dynamo's own record; loaded once it ran

    breaks = list(counters["graph_break"])
    return f" (after the graph break: {breaks[-1].strip().splitlines()[0]})" if breaks else ""


def _signature(gm: fx.GraphModule) -> int:
    """The same integer on every rank for the same graph (its generated code), below
    2**62 so that it and its negation fit an int64."""
    return int.from_bytes(hashlib.sha256(gm.code.encode()).digest()[:8], "big") >> 2


def _check_same_graph(signature: int, device: torch.device) -> None:
    """Every rank about to run the graph `signature`, or all raise: the all-reduced
    maxima of (s, -s) give the largest and smallest signature of the world."""
    if _differs(signature, dist.group.WORLD, device, torch.int64):
        raise RuntimeError(
            "autopart: the ranks are running different compiled graphs (the model's "
            "control flow depends on each rank's data), so their gradients cannot be "
            "averaged. Make every rank take the same branches, or use a model without "
            "data-dependent control flow"
        )


def _check_same_inputs(args: Sequence[Any], group: dist.ProcessGroup, device: torch.device) -> None:
    """The ranks of a tensor-parallel group compute one replica together, so they must
    feed it the same data; all of them raise if they do not."""
    data = [a for a in args if isinstance(a, torch.Tensor) and not isinstance(a, nn.Parameter)]
    total = 0.0
    for t in data:
        flat = t.detach().flatten().to(torch.float64)
        weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.float64) % 1009
        total += float((flat * (weights + 1)).sum())
    if _differs(total, group, device, torch.float64):
        raise RuntimeError(
            "autopart: the ranks of a tensor-parallel group fed different inputs. They "
            "compute one model replica together: give every rank of a tp group the same "
            "share of the batch (ranks r and r + 1 ... r + tp - 1 for r a multiple of tp)"
        )


def _differs(value: float, group: Any, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `value` differs anywhere in `group` (one all-reduce of (v, -v))."""
    both = torch.tensor([value, -value], dtype=dtype, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    return both[0].item() != value or -both[1].item() != value


def backend(mesh: Mesh | None = None, **pins: Any) -> AutopartBackend:
    """A torch.compile backend for `mesh` (the running world when None) and `pins`:
    `tp` (tensor-parallel degree; the solver lays the graph out), `dp` (checked against
    the world), `zero` (0 to 3), and `timeout` (seconds) for the collectives:
    `torch.compile(model, backend=autopart.backend(tp=2, zero=3))`."""
    return AutopartBackend(mesh, **pins)


autopart_backend = AutopartBackend()
