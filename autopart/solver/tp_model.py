"""The tensor-parallel layout per operator, chosen by CP-SAT from the costs.

Strategies. A parameter may stay replicated or be sharded on any dim that tp divides;
every other operator's strategies come from the rules the rewrite applies
(`passes.tp_rules`, through `tp_propagate.decide_node`): for each combination of
placements its operands can arrive in, the rule gives the output's placement, the
collectives it inserts, and whether the operator's work is split. A combination the
rules cannot handle is a fallback strategy (gather and compute whole), priced like any
other. Megatron's column/row pairs, head-sharded attention and sequence-parallel norms
are not rules here: they are the cheapest consistent choice when the costs say so.

Formulation, over the graph's operators with repeated blocks tied (each node of a copy
shares the variables of the first copy's node, and each parameter the first copy's
parameter of the same relative name, so a block is solved once for all its copies):

    x[v, p]     variable v (a node, or a parameter) takes placement p;  Σ_p x[v, p] = 1
    b[g, c]     operator group g runs combination c;                   Σ_c b[g, c] = 1
                  for each operand slot i and placement p:  Σ_{c: c_i = p} b[g, c] = x[src_i, p]
                  for the output:                           Σ_{c: out_c = p} b[g, c] = x[g, p]
    y[k]        conversion k is inserted:  y[k] ≥ b[g, c] for every (g, c) that needs it

A group is a node with the variables of its operands: the copies of a block node that
read the same variables (all but the first copy's boundary) form one group, weighted by
how many they are. A conversion is keyed as the rewrite shares it: by source, its
placement, the target and the consumers that may ask for it (copies with the same
consumers share a key, weighted by their number).

    minimize  Σ n_g cost(g, c) b[g, c]  +  Σ n_k cost(k) y[k]  +  Σ λ · state(v, p) x[v, p]

where cost(g, c) is the operator's time plus λ × the activations it saves, and λ the
memory price (`TpCosts.memory_price`; 0 where no plan could need the memory, as the
search says: `build_problem`'s `price_memory`). The costs are `cost_models.tp_costs`; the layout
the rewrite gives a choice is `tp_propagate.propagate` from the parameters' placements,
which the links above encode exactly (tests compare with a brute force over every
parameter placement). The pattern rule (`tensor_parallel.choose_tp_placements`) is
kept as one strategy generator: should the search not prove its optimum within its
work limit, it searches again from the pattern's layout.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from ortools.sat.python import cp_model
from torch import fx
from torch.distributed.tensor import Placement, Shard

from autopart.cost_models.tp_costs import DecisionCost, TpCosts
from autopart.ops.aten import WEIGHT_PRODUCTS, op_name
from autopart.ops.meta import BLOCK, SHAPE, TensorInfo
from autopart.passes.blocks import block_counterparts
from autopart.passes.tp_decision import Decision, NodePlacement, R, argument_leaves
from autopart.passes.tp_propagate import decide_node, gradient_flow, operands_of, propagate

log = logging.getLogger("autopart.solver")

SEED = 0
DETERMINISTIC_LIMIT = 5.0
# A node whose operands allow more placement combinations than this keeps only those
# where every operand is replicated or all share one placement.
MAX_COMBINATIONS = 256
# Costs are rounded to integers of 1/RESOLUTION of the largest group's cost.
RESOLUTION = 10**6

Var = fx.Node | str  # an operator, or a parameter by FQN


@dataclass
class Group:
    """Nodes that share their own and their operands' variables."""

    node: fx.Node  # the first of them, whose rule is applied
    var: Var
    sources: tuple[Var, ...]  # the variables of the node's distinct tensor operands
    count: int = 0
    combos: list[tuple[NodePlacement, ...]] = field(default_factory=list)
    outputs: list[NodePlacement] = field(default_factory=list)
    costs: list[DecisionCost] = field(default_factory=list)


@dataclass
class TpProblem:
    """The strategy tables of one graph at one tp degree, over the graph's
    `GraphVariables` (shared by the problems of every degree: read, never changed)."""

    tp: int
    candidates: dict[Var, list[NodePlacement]]
    groups: dict[tuple, Group]
    variables: GraphVariables
    state_cost: dict[tuple[str, Placement], float]  # per FQN, λ × its state bytes
    price: float  # λ, seconds per byte

    @property
    def var_of(self) -> dict[fx.Node, Var]:
        return self.variables.var_of

    @property
    def group_of(self) -> dict[fx.Node, tuple]:
        return self.variables.group_of

    @property
    def param_var(self) -> dict[str, str]:
        """Every parameter FQN -> the variable that places it."""
        return self.variables.param_var

    @property
    def conversion_sites(self) -> dict[tuple[Var, frozenset], int]:
        """(source variable, consumer groups) -> how many sources share that key."""
        return self.variables.conversion_sites

    def combo_cost(self, g: Group, c: int) -> float:
        cost = g.costs[c]
        return cost.seconds + self.price * cost.saved_bytes


@dataclass(frozen=True)
class GraphVariables:
    """What the layout problem of a graph shares at every tp degree: each node's
    variable, each parameter's, which nodes' values need a gradient, each operator's
    group key (its variable and its operands'), the groups' first nodes and sizes, and
    the conversion sites. The search builds a problem per degree and per sequence
    parallelism; walking a 1T model's graph for these once serves them all."""

    var_of: dict[fx.Node, Var]
    param_var: dict[str, str]
    grads: dict[fx.Node, bool]
    group_of: dict[fx.Node, tuple]
    groups: dict[tuple, tuple[fx.Node, int]]  # key -> (its first node, how many share it)
    conversion_sites: dict[tuple[Var, frozenset], int]

    @classmethod
    def of(cls, gm: fx.GraphModule, param_names: Mapping[str, str]) -> GraphVariables:
        var_of, param_var = _variables(gm, param_names)
        group_of: dict[fx.Node, tuple] = {}
        groups: dict[tuple, tuple[fx.Node, int]] = {}
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "get_attr"):
                continue
            sources = tuple(dict.fromkeys(var_of[s] for s in _tensor_sources(node)))
            key = group_of[node] = (var_of[node], sources)
            first, count = groups.get(key, (node, 0))
            groups[key] = (first, count + 1)
        sites = _conversion_sites(gm, group_of, var_of)
        return cls(var_of, param_var, gradient_flow(gm, param_names), group_of, groups, sites)


def build_problem(
    gm: fx.GraphModule,
    param_names: Mapping[str, str],
    tp: int,
    costs: TpCosts,
    sequence_parallel: bool = False,
    sharded_logits: int | None = None,
    variables: GraphVariables | None = None,
    price_memory: bool = True,
) -> TpProblem:
    """Every operator's strategies and their costs. `param_names`: get_attr target ->
    the parameter's FQN (one name per tensor); `sharded_logits`: the output leaf a
    vocabulary-parallel cross-entropy reads (`tp_propagate.decide_node`); `variables`:
    `GraphVariables.of(gm, param_names)`, where the caller keeps it. Without
    `price_memory`, memory costs nothing: the layout takes the least time."""
    shared = GraphVariables.of(gm, param_names) if variables is None else variables
    var_of, param_var, grads = shared.var_of, shared.param_var, shared.grads
    price = costs.memory_price() if price_memory else 0.0
    candidates: dict[Var, list[NodePlacement]] = {}
    state_cost = {}
    for var in set(param_var.values()):
        places = _parameter_placements(gm, var, tp)
        candidates[var] = list(places)
        for p in places:
            state_cost[(var, p)] = costs.state_bytes(var, p) * price
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            candidates.setdefault(var_of[node], [R])
    groups = {
        key: Group(first, key[0], key[1], count) for key, (first, count) in shared.groups.items()
    }

    def enumerate_group(group: Group) -> None:
        group.combos, group.outputs, group.costs = [], [], []
        _enumerate(
            group, gm, candidates, var_of, grads, tp, costs, sequence_parallel, sharded_logits
        )
        outs = candidates.setdefault(group.var, [])
        outs.extend(p for p in dict.fromkeys(group.outputs) if p not in outs)

    # In graph order, then again for the groups whose operands gained placements since:
    # a block's copies share variables, so a later copy's group (another boundary, as
    # the sequence-parallel input of every block but the first) can give a variable a
    # placement after the groups reading it were enumerated.
    seen: dict[tuple, tuple[int, ...]] = {}
    pending = list(groups)
    while pending:
        for key in pending:
            group = groups[key]
            seen[key] = tuple(len(candidates.get(v, ())) for v in group.sources)
            enumerate_group(group)
        pending = [
            key
            for key, group in groups.items()
            if tuple(len(candidates.get(v, ())) for v in group.sources) != seen[key]
        ]
    return TpProblem(tp, candidates, groups, shared, state_cost, price)


def _enumerate(
    group: Group,
    gm: fx.GraphModule,
    candidates: Mapping[Var, list[NodePlacement]],
    var_of: Mapping[fx.Node, Var],
    grads: Mapping[fx.Node, bool],
    tp: int,
    costs: TpCosts,
    sequence_parallel: bool,
    sharded_logits: int | None,
) -> None:
    node = group.node
    options = [candidates[v] for v in group.sources]
    if math.prod(len(o) for o in options) > MAX_COMBINATIONS:
        shared = dict.fromkeys(p for o in options for p in o)
        combos = [tuple(p if p in o else R for o in options) for p in shared]
    else:
        combos = list(itertools.product(*options))
    for combo in combos:
        chosen = dict(zip(group.sources, combo))
        places = {s: chosen[var_of[s]] for s in _tensor_sources(node)}
        ops = operands_of(node, places, grads, tp)
        try:
            decision = decide_node(ops, gm, sequence_parallel, sharded_logits)
        except (AssertionError, ValueError, TypeError, IndexError):
            continue  # a combination the rules cannot lay out: not a strategy
        group.combos.append(combo)
        group.outputs.append(decision.output)
        group.costs.append(costs.of(ops, decision, grads.get(node, False)))


def _tensor_sources(node: fx.Node) -> list[fx.Node]:
    return [
        s
        for s in node.all_input_nodes
        if s.op == "get_attr" or isinstance(SHAPE.get(s, None), TensorInfo | tuple)
    ]


def _conversion_sites(
    gm: fx.GraphModule, group_of: Mapping[fx.Node, tuple], var_of: Mapping[fx.Node, Var]
) -> dict[tuple, int]:
    """Sources that share a conversion key (their variable and their consumers'
    groups), counted: the rewrite inserts one conversion per source and target."""
    sites: dict[tuple, int] = defaultdict(int)
    for source in gm.graph.nodes:
        consumers = frozenset(group_of[u] for u in source.users if u in group_of)
        if consumers:
            sites[(var_of[source], consumers)] += 1
    return dict(sites)


def _parameter_placements(gm: fx.GraphModule, fqn: str, tp: int) -> list[Placement]:
    """Replicated, or sharded on any dim that `tp` divides."""
    shape = gm.get_parameter(fqn).shape
    return [R, *(Shard(d) for d, n in enumerate(shape) if n % tp == 0 and n >= tp)]


def _variables(
    gm: fx.GraphModule, param_names: Mapping[str, str]
) -> tuple[dict[fx.Node, Var], dict[str, str]]:
    """Node -> its variable (the first copy's node for a copy of a repeated block, the
    parameter's variable for a get_attr, itself otherwise), and parameter FQN -> its
    variable (the first copy's parameter of the same relative name)."""
    counterparts = block_counterparts(gm)
    var_of: dict[fx.Node, Var] = dict(counterparts)
    prefix: dict[str, str] = {}
    for node, first in counterparts.items():
        own, first_copy = BLOCK.get(node), BLOCK.get(first)
        if own is not None and first_copy is not None:
            prefix.setdefault(own.instance + ".", first_copy.instance + ".")
    order = {own: i for i, own in enumerate(prefix)}
    param_var = {fqn: _tied_fqn(fqn, prefix, order) for fqn in set(param_names.values())}
    for node in gm.graph.nodes:
        fqn = param_names.get(str(node.target)) if node.op == "get_attr" else None
        var_of[node] = param_var[fqn] if fqn else var_of.get(node, node)
    return var_of, param_var


def _tied_fqn(fqn: str, prefix: Mapping[str, str], order: Mapping[str, int]) -> str:
    """`fqn` under the first of `prefix`'s copies' prefixes it begins with (`order`: each
    one's place in `prefix`), made its first copy's: each of its own dotted prefixes
    looked up, not every copy's tried."""
    parts = fqn.split(".")
    begins = [".".join(parts[:i]) + "." for i in range(1, len(parts))]
    own = min((p for p in begins if p in order), key=order.__getitem__, default=None)
    return fqn if own is None else prefix[own] + fqn[len(own) :]


# ---------------------------------------------------------------------------------------
# Solving


@dataclass(frozen=True)
class TpSolution:
    placements: dict[str, Placement]  # FQN -> tp placement, for every sharded parameter
    cost: float  # the objective, seconds (unrounded)
    status: str


def solve_layout(
    problem: TpProblem,
    hint: Mapping[str, Placement] | None = None,
    pattern: Callable[[], Mapping[str, Placement]] | None = None,
    sharded: Collection[str] = (),
) -> TpSolution:
    """The cheapest consistent layout. `hint` (FQN -> placement) is where the search
    starts; `pattern` makes one (another strategy generator's layout) should the search
    not prove its optimum within its work limit, for a second search from it. The
    parameters in `sharded` (FQNs) must be sharded, on any dim."""
    start = time.perf_counter()
    built = _Model(problem)
    for param in {problem.param_var[fqn] for fqn in sharded}:
        if R in built.x[param]:
            built.model.add(built.x[param][R] == 0)
    if hint is not None:
        for var, places in built.x.items():
            if isinstance(var, str):
                for p, x in places.items():
                    built.model.add_hint(x, p == hint.get(var, R))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = SEED
    solver.parameters.max_deterministic_time = DETERMINISTIC_LIMIT
    status = solver.solve(built.model)
    if status != cp_model.OPTIMAL and hint is None and pattern is not None:
        return solve_layout(problem, pattern(), None, sharded)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise RuntimeError(f"the tensor-parallel model has no solution ({solver.status_name()})")
    chosen = {
        var: next(p for p, x in places.items() if solver.value(x))
        for var, places in built.x.items()
        if isinstance(var, str)
    }
    placements: dict[str, Placement] = {
        fqn: place
        for fqn, var in problem.param_var.items()
        if isinstance(place := chosen[var], Shard)
    }
    seconds = time.perf_counter() - start
    log.debug(
        "tp=%d layout: %d groups, %d terms, %s in %.3fs; %d parameters sharded",
        problem.tp,
        len(problem.groups),
        len(built.terms),
        solver.status_name(status),
        seconds,
        len(placements),
    )
    cost = sum(w for x, w in built.terms if solver.value(x))
    return TpSolution(placements, cost, solver.status_name(status))


class _Model:
    def __init__(self, problem: TpProblem) -> None:
        self.model = m = cp_model.CpModel()
        terms: list[tuple[cp_model.IntVar, float]] = []
        self.x: dict[Var, dict[NodePlacement, cp_model.IntVar]] = {}
        for var, places in problem.candidates.items():
            self.x[var] = {p: m.new_bool_var("") for p in places}
            m.add_exactly_one(self.x[var].values())
        copies = Counter(problem.param_var.values())
        for (var, place), cost in problem.state_cost.items():
            terms.append((self.x[var][place], copies[var] * cost))
        b: dict[tuple, list[cp_model.IntVar]] = {}
        for key, g in problem.groups.items():
            bs = b[key] = [m.new_bool_var("") for _ in g.combos]
            m.add_exactly_one(bs)
            for slot, source in enumerate(g.sources):
                for p, x in self.x[source].items():
                    m.add(sum(c for c, combo in zip(bs, g.combos) if combo[slot] == p) == x)
            for p, x in self.x[g.var].items():
                m.add(sum(c for c, out in zip(bs, g.outputs) if out == p) == x)
            terms.extend((c, g.count * problem.combo_cost(g, i)) for i, c in enumerate(bs))
        # A conversion is paid once per source, whichever of its consumers asks for it.
        for (source, consumers), count in problem.conversion_sites.items():
            needs: dict[tuple, tuple[float, list[cp_model.IntVar]]] = {}
            for gkey in consumers:
                g = problem.groups[gkey]
                for i, priced in enumerate(g.costs):
                    for conv in priced.conversions:
                        if problem.var_of[conv.source] == source:
                            needs.setdefault(conv.key, (conv.seconds, []))[1].append(b[gkey][i])
            for seconds, askers in needs.values():
                y = m.new_bool_var("")
                for asker in askers:
                    m.add_implication(asker, y)
                terms.append((y, count * seconds))
        top = max((w for _, w in terms), default=0.0)
        self.unit = RESOLUTION / top if top > 0 else 1.0
        m.minimize(sum(round(w * self.unit) * x for x, w in terms))
        self.terms = terms


def layout_cost(
    problem: TpProblem,
    gm: fx.GraphModule,
    param_names: Mapping[str, str],
    placements: Mapping[str, Placement],
    costs: TpCosts,
    sequence_parallel: bool = False,
    sharded_logits: int | None = None,
) -> float:
    """The objective of the layout the rewrite gives `placements`, walked by
    `tp_propagate.propagate` over the whole graph: what the model's optimum is checked
    against. Each operator is priced as its group's first node is (copies of a block
    share one price, as `GraphSummary` prices one copy for all), with the placements
    the walk gives its own operands; each conversion once per source and target."""
    result = propagate(gm, param_names, placements, problem.tp, sequence_parallel, sharded_logits)
    total = sum(
        costs.state_bytes(fqn, placements.get(fqn, R)) * problem.price
        for fqn in set(param_names.values())
    )
    conversions: dict[tuple, float] = {}
    for node in result.decisions:
        first = problem.groups[problem.group_of[node]].node
        by_var = {problem.var_of[s]: result.places[s] for s in _tensor_sources(node)}
        places = {s: by_var[problem.var_of[s]] for s in _tensor_sources(first)}
        ops = operands_of(first, places, result.grads, problem.tp)
        decision = decide_node(ops, gm, sequence_parallel, sharded_logits)
        cost = costs.of(ops, decision, result.grads[first])
        total += cost.seconds + problem.price * cost.saved_bytes
        own = dict(zip(_tensor_sources(first), _tensor_sources(node)))
        for conv in cost.conversions:
            conversions[(own[conv.source], conv.key)] = conv.seconds
    return total + sum(conversions.values())


def parameter_roles(
    gm: fx.GraphModule,
    param_names: Mapping[str, str],
    placements: Mapping[str, Placement],
    decisions: Mapping[fx.Node, Decision],
) -> dict[str, str]:
    """What each sharded parameter does under the layout, for `plan.explain()`:
    column-parallel, row-parallel, vocabulary-parallel, gathered when used (sharded
    for memory, whole for compute), or sharded along with its operator. `decisions`:
    the walk's under the layout (`TpLayout.walk`)."""
    roles: dict[str, str] = {}
    for node in gm.graph.nodes:
        fqn = param_names.get(str(node.target)) if node.op == "get_attr" else None
        if fqn is None or fqn not in placements:
            continue
        found = [_role(user, read, decisions[user]) for user, read in _readers(node)]
        roles[fqn] = min(found, key=ROLES.index) if found else ROLES[-1]
    return roles


ROLES = (
    "vocabulary-parallel",
    "row-parallel",
    "column-parallel",
    "gathered when used",
    "sharded with its operator",
)


def _readers(node: fx.Node) -> list[tuple[fx.Node, fx.Node]]:
    """(operator, the operand it reads) for each operator reading `node`, a parameter,
    through transposes (an expert's stacked weights are read as [E, in, out])."""
    out = []
    for user in node.users:
        if op_name(user) in ("transpose", "t", "permute"):
            out += _readers(user)
        else:
            out.append((user, node))
    return out


def _role(user: fx.Node, param: fx.Node, decision: Decision) -> str:
    slots = [i for i, leaf in enumerate(argument_leaves(user)) if leaf is param]
    if decision.local_op:
        return ROLES[0]
    if decision.fallback or any(decision.inputs.get(i) == R for i in slots):
        return ROLES[3]
    if decision.reduce_to is not None:
        return ROLES[1]
    if op_name(user) in WEIGHT_PRODUCTS and isinstance(decision.output, Shard):
        return ROLES[2]
    return ROLES[4]
