"""Choosing a plan: the mesh factorization and everything else the user did not pin."""

from autopart.solver.pins import Pins, make_plan, recompute_refusal

__all__ = ["Pins", "make_plan", "recompute_refusal"]
