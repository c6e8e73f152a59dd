"""Placements as text: "R" (Replicate), "S(dim)" (Shard), "P" (Partial sum)."""

from __future__ import annotations

from torch.distributed.tensor import Partial, Placement, Replicate, Shard


class PlacementError(ValueError):
    """Text that names no placement."""


def placement_to_str(p: Placement) -> str:
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Partial):
        return "P"
    if isinstance(p, Replicate):
        return "R"
    raise PlacementError(f"unsupported placement {p!r}")


def placement_from_str(text: str) -> Placement:
    text = text.strip()
    if text == "R":
        return Replicate()
    if text == "P":
        return Partial()
    if text.startswith("S(") and text.endswith(")"):
        return Shard(int(text[2:-1]))
    raise PlacementError(f"bad placement {text!r}: expected 'R', 'P' or 'S(dim)'")
