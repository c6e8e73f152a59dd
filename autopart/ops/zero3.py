"""ZeRO-3 at run time: parameters sharded over the data-parallel ranks, gathered on use.
Each bucket has its own group (`ShardGroup`): under expert parallelism the experts'
buckets are sharded over their dp replicas, the other weights' over dp × ep.

`zero3_pass` (passes/zero.py) replaces a stage's parameters by a `ShardedParameters`
module, the stage's `zero3` submodule: one flat shard (an nn.Parameter) per bucket of
parameters, the only parameters the optimizer sees. The stage's graph reads a bucket
through two nodes,

    pending = all_gather_start(zero3, b)           issue the all-gather (asynchronous)
    params  = all_gather_wait(zero3, b, pending)   wait; the bucket's parameters, as views

and the second is an autograd Function whose backward flattens the parameters'
gradients and reduce-scatters them, asynchronously, into the shard's `.grad` (the mean
over the data-parallel ranks; an expert's, summed over its dp replicas, divided by the
batch's dp × ep shares).

Memory in backward. Operators save their inputs for backward, gathered parameters
among them, which would keep every bucket whole from forward until backward. While the
stage runs forward, saved-tensor hooks replace a saved tensor that lies in a gathered
bucket by a small token (bucket, offset, size, stride); backward turns the token back
into a tensor by gathering the bucket again, once, and prefetches the bucket it will
need next. A bucket gathered for backward is dropped once its gradients are reduced.

Recomputation. A recomputed region (passes/recompute.py, non-reentrant checkpointing)
saves its inputs under the hooks in force, as an operator saves its own, so the
parameters it reads leave tokens too and nothing it gathered stays whole until
backward. Its recomputation turns them back into tensors there: that is backward's
gather of those buckets, shared by the recomputed operators and their gradients, as
FSDP gathers a checkpointed block once in backward. The recomputation takes them all
at once, not one after another as operators' backward does, so backward gathers a
region's buckets together (`gathered_with`), and prefetches the previous region's
whole while the region runs: two regions' parameters at most, each dropped once its
gradients are reduced.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed import GroupName

from autopart.ops.flat_buckets import FlatLayout, GradientReducer, all_gather_flat
from autopart.ops.params import lower

ZERO3 = "zero3"  # the attribute of a stage module that holds its ShardedParameters


@dataclass(frozen=True, slots=True)
class ShardGroup:
    """The ranks a bucket is sharded over: their process group, this rank's place and
    their number, the mesh axes they span (for reports), and what the bucket's summed
    gradients are divided by (their number, unless given: an expert's by the batch's
    shares, `ExpertShards`)."""

    name: GroupName
    rank: int
    size: int
    axes: str
    divisor: int | None = None


@dataclass(frozen=True, slots=True)
class _Pending:
    """An all-gather in flight: `flat` is filled once `work` completes."""

    flat: torch.Tensor
    work: dist.Work | None

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.flat


@dataclass(frozen=True, slots=True)
class _Saved:
    """A tensor saved for backward that lies in a gathered bucket: where, not what."""

    bucket: int
    offset: int | torch.SymInt
    size: torch.Size
    stride: tuple[int, ...]


class ShardedParameters(nn.Module):
    """This rank's shards of a stage's parameters, and the gathers that rebuild them."""

    def __init__(
        self,
        names: Sequence[Sequence[str]],
        params: Sequence[Sequence[torch.Tensor]],
        over: Sequence[ShardGroup],
        gathered_with: Sequence[Sequence[int]] = (),
    ) -> None:
        """`names[b]` and `params[b]`: the FQNs and values of bucket b's parameters,
        sharded over `over[b]`; `gathered_with[b]`: the buckets backward gathers with
        it (those of the recomputed regions that read it; none where not given)."""
        super().__init__()
        self.names = [tuple(n) for n in names]
        self.over = tuple(over)
        self.gathered_with = tuple(tuple(g) for g in gathered_with) or tuple(() for _ in names)
        self.layouts = [FlatLayout.of(ps, g.size) for ps, g in zip(params, over)]
        self.shards = nn.ParameterList(
            nn.Parameter(
                layout.shard_of([p.detach() for p in ps], g.rank),
                requires_grad=ps[0].requires_grad,
            )
            for layout, ps, g in zip(self.layouts, params, over)
        )
        self._reducers: dict[GroupName, GradientReducer] = {}
        self._contexts: list[saved_tensors_hooks] = []
        # storage address -> (bucket, its gathered flat buffer) for every gather alive
        self._gathered: dict[int, tuple[int, weakref.ref[torch.Tensor]]] = {}
        self._for_backward: dict[int, torch.Tensor] = {}
        self._prefetched: dict[int, _Pending] = {}
        self._next_in_backward: dict[int, int] = {}
        self._last_packed: int | None = None
        self.peak_gathered_bytes = 0  # the most alive at once since the step began
        # 16-bit parameters (`compute_in`): gathers move 16-bit copies of the fp32 shards
        # and gradients are reduced in `_reduce_dtype`; None: both in the shards' dtype.
        self._compute_dtype: torch.dtype | None = None
        self._reduce_dtype: torch.dtype | None = None
        self._copies: dict[int, tuple[int, torch.Tensor]] = {}  # bucket -> (version, copy)

    def group(self, bucket: int) -> dist.ProcessGroup:
        return dist.distributed_c10d._resolve_process_group(self.over[bucket].name)

    def reducer(self, bucket: int) -> GradientReducer:
        over = self.over[bucket]
        if over.name not in self._reducers:
            self._reducers[over.name] = GradientReducer(self.group(bucket), over.divisor)
        return self._reducers[over.name]

    def install(self, gm: fx.GraphModule) -> None:
        """Run the stage's forward under the saved-tensor hooks. The hooks find the
        shards the stage holds when it runs, not these: a program made again for inputs
        of a new shape takes the first program's shards in place of its own
        (ops/program.py `sharing_tensors`)."""
        gm.register_forward_pre_hook(_enter_forward)
        gm.register_forward_hook(_exit_forward, always_call=True)

    # -- the step (ShardedPart) --------------------------------------------------------

    def begin(self) -> None:
        self._next_in_backward.clear()
        self.peak_gathered_bytes = self.gathered_bytes()
        for shard in self.shards:
            shard.grad = None

    def finish(self) -> None:
        """Wait for every gradient reduction; drop what backward gathered."""
        for reducer in self._reducers.values():
            reducer.drain()
        for pending in self._prefetched.values():
            pending.wait()
        self._prefetched.clear()
        self._for_backward.clear()

    def after_step(self) -> None:
        """Nothing to do: the next forward gathers the updated shards."""

    def compute_in(self, dtype: torch.dtype, reduce_dtype: torch.dtype) -> None:
        """16-bit parameters, FSDP2's mixed precision: the shards stay the fp32 masters the
        optimizer steps, the stage computes with `dtype` copies, gathered as such (half
        the bytes), and the gradients are reduced in `reduce_dtype` into the shards'."""
        self._compute_dtype, self._reduce_dtype = dtype, reduce_dtype
        self._copies.clear()

    def _to_gather(self, bucket: int) -> torch.Tensor:
        """What rank's gather sends of `bucket`: its shard, or the shard's copy in the
        compute dtype, made again whenever the shard has changed since (its version
        counter moves with every in-place write: the optimizer's step, a load), so once
        a step."""
        shard = self.shards[bucket]
        if self._compute_dtype is None:
            return shard
        held = self._copies.get(bucket)
        if held is None or held[0] != shard._version:
            held = self._copies[bucket] = (shard._version, shard.detach().to(self._compute_dtype))
        return held[1]

    def lower(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """Hold the trained shards in `dtype` (16-bit copies of master weights kept
        elsewhere), so that they are gathered and reduced in it: the shards lowered."""
        return lower([shard for shard in self.shards if shard.requires_grad], dtype)

    def close(self) -> None:
        """No hooks on the user's parameters: the shards are autopart's own."""

    def gathered_bytes(self) -> int:
        """Bytes of gathered buckets this rank still holds (the process group's backend
        may keep a completed gather's output a moment longer: not counted)."""
        flats = (ref() for _, ref in self._gathered.values())
        return sum(f.numel() * f.element_size() for f in flats if f is not None)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, under its FQN (collective over each bucket's group)."""
        out: dict[str, torch.Tensor] = {}
        for b, (names, layout) in enumerate(zip(self.names, self.layouts)):
            flat, _ = all_gather_flat(self.shards[b], layout, self.group(b))
            out.update((n, v.clone()) for n, v in zip(names, layout.views(flat)))
        return out

    # -- gathering ---------------------------------------------------------------------

    def start_gather(self, bucket: int) -> _Pending:
        layout, group = self.layouts[bucket], self.group(bucket)
        output, work = all_gather_flat(self._to_gather(bucket), layout, group, True)
        # Track and hand out a second tensor over the output's storage, not the tensor the
        # backend fills: its worker may hold that one for a moment after the work completes,
        # and a tensor held from C++ stays alive in Python, so a weak reference to it would
        # count a bucket this rank has released.
        flat = output.new_empty(0).set_(output.untyped_storage(), 0, output.shape, output.stride())
        self._gathered = {
            ptr: entry for ptr, entry in self._gathered.items() if entry[1]() is not None
        }
        self._gathered[flat.untyped_storage().data_ptr()] = (bucket, weakref.ref(flat))
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes())
        return _Pending(flat, work)

    def reduce_gradients(self, bucket: int, grads: Sequence[torch.Tensor | None]) -> None:
        """Backward of a gather: reduce-scatter the bucket's gradients into its shard.
        No gradient at all (the same on every rank: it depends on the graph, not the
        data) leaves the shard's gradient as it is, as on one device."""
        self._for_backward.pop(bucket, None)
        if all(g is None for g in grads):
            return
        shard = self.shards[bucket]
        like = shard if self._reduce_dtype is None else shard.new_empty(0, dtype=self._reduce_dtype)
        self.reducer(bucket).launch(self.layouts[bucket].flatten(grads, like=like), shard)

    def _gathered_for_backward(self, bucket: int) -> torch.Tensor:
        flat = self._for_backward.get(bucket)
        if flat is None:
            self._prefetch(bucket)
            flat = self._for_backward[bucket] = self._prefetched.pop(bucket).wait()
            following = self._next_in_backward.get(bucket)
            if following is not None:
                self._prefetch(following)
        return flat

    def _prefetch(self, bucket: int) -> None:
        """Issue the gathers of `bucket`, then of the buckets backward gathers with it,
        but for those held or issued already."""
        for b in dict.fromkeys((bucket, *self.gathered_with[bucket])):
            if b not in self._for_backward and b not in self._prefetched:
                self._prefetched[b] = self.start_gather(b)

    # -- saved-tensor hooks ------------------------------------------------------------

    def _enter_forward(self, module: nn.Module, args: Any) -> None:
        context = saved_tensors_hooks(self._pack, self._unpack)
        context.__enter__()
        self._last_packed = None  # one forward's order of buckets; not across microbatches
        self._contexts.append(context)

    def _exit_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self._contexts.pop().__exit__(None, None, None)

    def _pack(self, t: torch.Tensor) -> torch.Tensor | _Saved:
        if t.layout != torch.strided or t.numel() == 0:
            return t
        try:
            entry = self._gathered.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # a tensor without storage
            return t
        if entry is None:
            return t
        bucket, ref = entry
        flat = ref()
        if flat is None or t.dtype != flat.dtype:
            return t
        if self._last_packed is not None and self._last_packed != bucket:
            # Backward runs forward's buckets in reverse: after `bucket`, the previous one.
            self._next_in_backward.setdefault(bucket, self._last_packed)
        self._last_packed = bucket
        return _Saved(bucket, t.storage_offset(), t.size(), t.stride())

    def _unpack(self, saved: torch.Tensor | _Saved) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved
        flat = self._gathered_for_backward(saved.bucket)
        return flat.as_strided(saved.size, saved.stride, saved.offset)


class _GatherBucket(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, shard: torch.Tensor, params: ShardedParameters, bucket: int, pending: _Pending
    ) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.params, ctx.bucket = params, bucket
        return params.layouts[bucket].views(pending.wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, ...]:
        # The shard's gradient arrives asynchronously (GradientReducer), not through autograd.
        ctx.params.reduce_gradients(ctx.bucket, grads)
        return None, None, None, None


def _enter_forward(stage: nn.Module, args: Any) -> None:
    _held(stage)._enter_forward(stage, args)


def _exit_forward(stage: nn.Module, args: Any, output: Any) -> None:
    _held(stage)._exit_forward(stage, args, output)


def _held(stage: nn.Module) -> ShardedParameters:
    params = sharded_parameters(stage)
    assert params is not None, "zero3_pass installs the hooks on a stage it gives shards"
    return params


# Both run as they are under torch.compile: they read and write the gathers' Python
# state, which dynamo would guard on (and recompile for at every bucket); the compiled
# program runs in regions between them.
@torch.compiler.disable
def all_gather_start(params: ShardedParameters, bucket: int) -> _Pending:
    """Issue the all-gather of a bucket's shards; `all_gather_wait` takes the result."""
    return params.start_gather(bucket)


@torch.compiler.disable
def all_gather_wait(
    params: ShardedParameters, bucket: int, pending: _Pending
) -> tuple[torch.Tensor, ...]:
    """The bucket's parameters, whole; in backward, their gradients reduce-scattered."""
    return _GatherBucket.apply(params.shards[bucket], params, bucket, pending)


def sharded_parameters(gm: nn.Module) -> ShardedParameters | None:
    """A stage's ZeRO-3 shards, if zero3_pass has run on it."""
    module = getattr(gm, ZERO3, None)
    return module if isinstance(module, ShardedParameters) else None


def full_state_dict(gm: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of a stage, under its FQN: ZeRO-3's gathered whole (collective
    over the dp group), the others as they are. Copies, detached."""
    zero3 = sharded_parameters(gm)
    own = {name: p.detach().clone() for name, p in gm.named_parameters()}
    if zero3 is None:
        return own
    prefix = f"{ZERO3}."
    return {
        **{name: p for name, p in own.items() if not name.startswith(prefix)},
        **zero3.full_state_dict(),
    }
