"""The tensor-parallel layouts a search prices, one per tp degree and sequence
parallelism: made once per plan, by the per-operator layout model (`tp_model`), with
their graph summaries; and whether memory is worth pricing in them at all
(`memory_may_bind`)."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

from torch import fx
from torch.distributed.tensor import Placement, Shard

from autopart.batch import BATCH
from autopart.cost_models import Choices, CostModels, GraphSummary, predict
from autopart.cost_models.summary import TpLayout
from autopart.cost_models.tp_costs import TpCosts
from autopart.cost_models.work import ATTENTION
from autopart.degrees import Degrees
from autopart.mesh import Mesh
from autopart.passes.context_parallel import sequence_length
from autopart.passes.experts import ExpertLayer, expert_layers
from autopart.passes.tp_decision import R, argument_leaves
from autopart.passes.tp_propagate import Propagation
from autopart.policy import Precision
from autopart.solver.tensor_parallel import choose_tp_placements
from autopart.solver.tp_model import (
    GraphVariables,
    TpSolution,
    build_problem,
    parameter_roles,
    solve_layout,
)

if TYPE_CHECKING:
    from autopart.solver.pins import Pins

# The share of a device's memory one device's plan of a model must fit in for no plan
# to need what a tensor-parallel layout's shards save (`memory_may_bind`).
MEMORY_ROOM = 0.5


class TpLayouts:
    """Per tp degree and sequence parallelism (on or off), made once: the layout the
    rewrite will give the model (chosen by the per-operator model, `tp_model`, from the
    costs on `mesh` at the sizes `dims`), and the graph summary priced under it, so that
    the search prices what will run. `sharded_logits`: the output leaf a
    vocabulary-parallel cross-entropy will read (a standard cross-entropy the runtime
    recognized), whose gather the layout then saves.

    The layout with sequence parallelism must shard every parameter the one without it
    shards (on any dim): solved freely, it can trade whole weights for fewer collectives
    (an MLP replicated on sequence shards), a memory cost the layout model's price of
    memory does not bound but the device's memory would.

    `memory_priced`: whether the layout model prices memory (`tp_model.build_problem`),
    set before any layout is made. `make_plan` leaves it off where tp is free and no
    plan could need the memory a layout saves (`memory_may_bind`): there a layout that
    gathers a weight at every use to hold a shard of it only adds time, and tp is
    chosen only where it saves time."""

    def __init__(
        self,
        gm: fx.GraphModule,
        param_names: Mapping[str, str],
        mesh: Mesh,
        dims: Mapping[str, int],
        precision: str = Precision.FP32,
        sharded_logits: int | None = None,
    ) -> None:
        self.gm, self.param_names, self.sharded_logits = gm, param_names, sharded_logits
        self.mesh, self.dims, self.precision = mesh, {**dims, BATCH: 1}, precision
        self._solutions: dict[tuple[int, bool], TpSolution] = {}
        self._summaries: dict[tuple[int, bool], GraphSummary] = {}
        self._layouts: dict[tuple[int, bool], TpLayout] = {}
        self._splits_experts: dict[tuple[int, bool], bool] = {}
        self.memory_priced = True

    def placements(self, tp: int, sp: bool = False) -> dict[str, Placement]:
        """The layout at `tp` ranks, with sequence parallelism where `sp`."""
        return self._solution(tp, sp).placements if tp > 1 else {}

    def sequence_parallel(self, tp: int, pinned: bool | None = None) -> bool:
        """Whether the layout at `tp` runs sequence parallel: as pinned, else where the
        layout model's objective (its time and its memory, priced) says it pays."""
        if tp == 1:
            return False
        if pinned is not None:
            return pinned
        return self._solution(tp, True).cost < self._solution(tp, False).cost

    def _solution(self, tp: int, sp: bool) -> TpSolution:
        if (tp, sp) not in self._solutions:
            costs = TpCosts(self.gm, CostModels.of(self.mesh, self.precision), self.dims, tp)
            problem = build_problem(
                self.gm,
                self.param_names,
                tp,
                costs,
                sp,
                self.sharded_logits,
                self._variables,
                self.memory_priced,
            )
            pattern = functools.partial(choose_tp_placements, self.gm, self.param_names, tp)
            sharded = self.placements(tp) if sp else {}
            self._solutions[tp, sp] = solve_layout(problem, pattern=pattern, sharded=sharded)
        return self._solutions[tp, sp]

    @functools.cached_property
    def _variables(self) -> GraphVariables:
        return GraphVariables.of(self.gm, self.param_names)

    @functools.cached_property
    def _expert_layers(self) -> list[ExpertLayer]:
        return expert_layers(self.gm, self.param_names)

    @property
    def expert_params(self) -> tuple[str, ...]:
        """The FQNs of every routed layer's stacked expert weights."""
        return tuple(fqn for layer in self._expert_layers for fqn in layer.params)

    @property
    def experts(self) -> int | None:
        """The number of experts every routed layer of the model has (the largest that
        divides them all), or None where it has no layer expert parallelism splits."""
        layers = self._expert_layers
        return math.gcd(*(layer.experts for layer in layers)) if layers else None

    def splits_experts(self, tp: int, sp: bool = False) -> bool:
        """Whether the layout at `tp` runs every expert layer as expert parallelism can
        split it: no collective from its first grouped multiply to its last (a weight
        gathered, a partial sum reduced, a split of parts gathered), so that the layer
        stays one segment of row-wise operators and ep cuts each rank's run of experts
        from the tp slices (`passes/expert_parallel.py`)."""
        if tp == 1 or not self._expert_layers:
            return True
        if (tp, sp) not in self._splits_experts:
            self._splits_experts[tp, sp] = self._no_collective_in_expert_layers(tp, sp)
        return self._splits_experts[tp, sp]

    def _no_collective_in_expert_layers(self, tp: int, sp: bool) -> bool:
        result = self._walk(tp, sp)
        for layer in self._expert_layers:
            for node in layer.inside | set(layer.matmuls):
                decision = result.decisions[node]
                if decision.fallback or (decision.reduce_to and node not in layer.exits):
                    return False
                leaves = argument_leaves(node)
                for i, target in decision.inputs.items():
                    if not (result.operand_place(leaves[i]) == R and isinstance(target, Shard)):
                        return False  # not a local slice of a replicated operand
        return True

    def ring_sequence(self) -> int | None:
        """The sequence length context parallelism splits: the dynamic sequence's size
        where the model attends over it (ring attention), else None."""
        segments = self.summary(1).evaluate(self.dims)
        attends = any(w.kind == ATTENTION for s in segments for w in s.nodes)
        return sequence_length(self.gm, self.dims) if attends else None

    def roles(self, tp: int, sp: bool = False) -> dict[str, str]:
        """What each sharded parameter does in the layout (`parameter_roles`)."""
        if tp == 1:
            return {}
        decisions = self._walk(tp, sp).decisions
        return parameter_roles(self.gm, self.param_names, self.placements(tp, sp), decisions)

    def summary(self, tp: int, sp: bool = False) -> GraphSummary:
        key = (tp, sp and tp > 1)
        if key not in self._summaries:
            layout = self._layout(tp, sp) if tp > 1 else None
            like = self.summary(1) if tp > 1 else None  # its layout-free analysis, shared
            self._summaries[key] = GraphSummary(self.gm, layout, like, self.sharded_logits)
        return self._summaries[key]

    def _layout(self, tp: int, sp: bool) -> TpLayout:
        """The rewrite's layout at `tp` > 1, made once: the summary prices it, and its
        walk answers the roles and the expert layers' test."""
        if (tp, sp) not in self._layouts:
            placements = self.placements(tp, sp)
            self._layouts[tp, sp] = TpLayout.of(self.gm, placements, tp, sp, self.sharded_logits)
        return self._layouts[tp, sp]

    def _walk(self, tp: int, sp: bool) -> Propagation:
        return self._layout(tp, sp).walk


def memory_may_bind(
    layouts: TpLayouts, mesh: Mesh, pins: Pins, global_batch: int, dims: Mapping[str, int]
) -> bool:
    """Whether some plan could need the memory a tensor-parallel layout saves: unless
    one device's plan (every parameter with its gradient and optimizer state, the whole
    batch in one microbatch, nothing recomputed) fits in `MEMORY_ROOM` of the device's
    memory. Any other plan holds at most that on a rank (a pipeline's microbatches in
    flight are within the whole batch), but for its collectives' buffers, which the
    room leaves space for."""
    room = MEMORY_ROOM * mesh.device.memory_bytes
    summary = layouts.summary(1)
    models = CostModels.of(mesh, pins.precision, pins.compile)
    params = sum(s.param_numel() for s in summary.evaluate({**dims, BATCH: 1}))
    states = models.memory.breakdown(params, 1, 0, master_weights=pins.master_weights)
    if sum(states.values()) > room:
        return True  # a large model: known without pricing its activations
    # Priced on every rank of the mesh as data parallelism, each rank holding the
    # whole batch: what one device's plan holds, with the sync's buffers besides.
    world = mesh.world_size
    one = Choices(
        global_batch * world,
        Degrees(dp=world),
        precision=pins.precision,
        master_weights=pins.master_weights,
        compiled=pins.compile,
    )
    return predict(summary, mesh, one, dims, models).peak_memory_bytes > room
