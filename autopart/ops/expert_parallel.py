"""Expert parallelism's operators: each routed row to the rank that holds its expert, and
back.

Under expert parallelism the E experts of a layer are split over the ep ranks in
contiguous runs: rank r holds experts [r·E/ep, (r+1)·E/ep). Every rank routes its own
tokens as one device would, into rows sorted by expert (one row per token and chosen
expert), with the cumulative row count per expert (`offsets`, as grouped matrix
multiplies take them). Since the rows are sorted, the rows for one rank's experts are
contiguous, and one `all_to_all_single` moves them:

    function          forward                              backward
    ep_route          exchange the row counts: who sends   -
                      whom how many rows, for which expert
    ep_to_experts     rows to their experts' ranks, then   the reverse: gradients back
                      ordered by local expert              to the rows' ranks
    ep_from_experts   expert outputs back to the rows'     the reverse
                      ranks, in their original order
    ep_local_offsets  cumulative rows per local expert     -

Nothing is dropped or padded (dropless): every row reaches its expert, so a rank's
experts compute exactly the rows one device's would, and the layer matches one device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Function
from torch.distributed import GroupName

from autopart.ops.layout import DimOrder, in_dim_order


@dataclass(frozen=True)
class ExpertRoute:
    """One layer's exchange on one rank: the rows it sends each ep rank (`sent`), the
    rows it receives from each (`received`), and `order`, the permutation that puts the
    received rows (grouped by sender, each sender's sorted by expert) in local-expert
    order. `local_counts` is the rows each local expert computes."""

    group: dist.ProcessGroup
    sent: list[int]
    received: list[int]
    order: torch.Tensor
    local_counts: torch.Tensor


def ep_route(offsets: torch.Tensor, group: GroupName) -> ExpertRoute:
    """The exchange of a layer whose rows, sorted by expert, end at `offsets` (one per
    expert of the whole layer): one all_to_all of the per-expert row counts."""
    pg = dist.distributed_c10d._resolve_process_group(group)
    ep = dist.get_world_size(pg)
    experts = offsets.numel()
    if experts % ep:
        raise ValueError(
            f"expert parallelism splits a layer's {experts} experts over ep = {ep} ranks: "
            f"choose an ep that divides {experts}"
        )
    with torch.no_grad():
        counts = torch.diff(
            offsets.to(torch.int64), prepend=offsets.new_zeros(1, dtype=torch.int64)
        )
        incoming = torch.empty_like(counts)
        dist.all_to_all_single(incoming, counts, group=pg)
        by_sender = incoming.view(ep, experts // ep)  # [sender, local expert]
        sent = counts.view(ep, experts // ep).sum(1).tolist()
        received = by_sender.sum(1).tolist()
        order = _expert_major(by_sender)
    return ExpertRoute(pg, sent, received, order, by_sender.sum(0))


def _expert_major(by_sender: torch.Tensor) -> torch.Tensor:
    """The indices that take rows laid out sender-major (sender 0's rows for each local
    expert, then sender 1's ...) to expert-major (expert 0's rows from each sender ...)."""
    lengths = by_sender.reshape(-1)
    starts = (lengths.cumsum(0) - lengths).view_as(by_sender)
    segment_lengths = by_sender.t().reshape(-1)  # in expert-major order
    segment_starts = starts.t().reshape(-1)
    placed_at = segment_lengths.cumsum(0) - segment_lengths
    total = int(segment_lengths.sum())
    shift = torch.repeat_interleave(segment_starts - placed_at, segment_lengths)
    return shift + torch.arange(total, device=by_sender.device)


def ep_local_offsets(route: ExpertRoute, like: torch.Tensor) -> torch.Tensor:
    """The cumulative row counts of this rank's experts, as `like` (the layer's offsets)
    holds them."""
    return route.local_counts.cumsum(0).to(like.dtype)


def _exchange(rows: torch.Tensor, send: list[int], receive: list[int], pg: Any) -> torch.Tensor:
    out = rows.new_empty((sum(receive), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), receive, send, group=pg)
    return out


def _to_experts(rows: torch.Tensor, route: ExpertRoute) -> torch.Tensor:
    arrived = _exchange(rows, route.sent, route.received, route.group)
    return arrived[route.order]


def _from_experts(rows: torch.Tensor, route: ExpertRoute) -> torch.Tensor:
    by_sender = torch.empty_like(rows)
    by_sender[route.order] = rows
    return _exchange(by_sender, route.received, route.sent, route.group)


class _ToExperts(Function):
    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, route: ExpertRoute) -> torch.Tensor:
        ctx.route = route
        return _to_experts(rows, route)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _from_experts(grad, ctx.route), None


class _FromExperts(Function):
    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, route: ExpertRoute) -> torch.Tensor:
        ctx.route = route
        return _from_experts(rows, route)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _to_experts(grad, ctx.route), None


def ep_to_experts(rows: torch.Tensor, route: ExpertRoute) -> torch.Tensor:
    return _ToExperts.apply(rows, route)


def ep_from_experts(
    rows: torch.Tensor, route: ExpertRoute, dim_order: DimOrder | None = None
) -> torch.Tensor:
    """The experts' output rows back on their ranks, standing in for the layer's last
    grouped multiply: in that multiply's captured `dim_order` (`ops.layout`)."""
    return in_dim_order(_FromExperts.apply(rows, route), dim_order)
