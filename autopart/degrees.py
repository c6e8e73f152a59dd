"""The mesh axes, and how many ways each one splits the world.

`Degrees` is the one type that knows the axes: it checks their product against the
world, gives each axis's stride in the device mesh, lists the axes in use, enumerates
every factorization of a world, and builds the named `DeviceMesh`. Plans, pins, the
cost models and the search hold a `Degrees` and iterate its axes, so an axis added to
`MESH_AXES` (and to `Axis`) is planned without changes elsewhere; only the passes,
cost terms and runtime that implement what the axis does are new.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# A process group's backend and its options (a c10d Backend.Options: its timeout), as
# DeviceMesh takes them.
GroupOptions = tuple[str, Any]


class Axis(StrEnum):
    """The mesh axes. "axis" always means one of these; "dim" means a tensor dimension."""

    DP = "dp"
    EP = "ep"
    CP = "cp"
    TP = "tp"
    PP = "pp"


# The axes of a DeviceMesh, outermost first: pp outermost, tp innermost, so that tensor
# parallel groups are consecutive ranks and land inside one node; cp (the sequence)
# next to them, whose ring exchanges keys and values every block; ep (the experts)
# next, whose all_to_all moves every routed token twice per layer.
MESH_AXES: tuple[Axis, ...] = (Axis.PP, Axis.DP, Axis.EP, Axis.CP, Axis.TP)

# The axes the batch is split over: the data-parallel replicas, and within each the
# expert-parallel ranks (each routes its own share of the tokens to every rank's experts).
BATCH_AXES: tuple[Axis, ...] = (Axis.DP, Axis.EP)


class MeshError(ValueError):
    """A mesh that does not match the world it is used in, or a bad factorization."""


@dataclass(frozen=True, slots=True, init=False)
class Degrees:
    """How many ways each axis splits the world, in `MESH_AXES` order; an axis not
    given has degree 1. `Degrees(dp=2, tp=4)` or `Degrees({Axis.DP: 2, Axis.TP: 4})`."""

    axes: tuple[Axis, ...]
    sizes: tuple[int, ...]
    # name -> degree, for `degrees["dp"]` and `plan.dp` (the search reads them millions
    # of times); an Axis hashes as its name.
    _by_name: dict[str, int] = field(repr=False, compare=False)

    def __init__(self, sizes: Mapping[Any, int] | None = None, /, **by_name: int) -> None:
        axes = MESH_AXES
        names = axis_names()
        given = {str(a): n for a, n in {**(sizes or {}), **by_name}.items()}
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise MeshError(f"unknown mesh axes {unknown}: the axes are {names}")
        for name, n in given.items():
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise MeshError(f"the degree of {name} must be a positive integer, not {n!r}")
        object.__setattr__(self, "axes", axes)
        object.__setattr__(self, "sizes", tuple(given.get(name, 1) for name in names))
        object.__setattr__(self, "_by_name", dict(zip(names, self.sizes)))

    # -- reading ----------------------------------------------------------------------

    def __getitem__(self, axis: Axis | str) -> int:
        try:
            return self._by_name[axis]
        except KeyError:
            raise MeshError(f"unknown mesh axis {str(axis)!r}: the axes are {self.names}") from None

    def items(self) -> tuple[tuple[Axis, int], ...]:
        return tuple(zip(self.axes, self.sizes))

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    @property
    def enabled(self) -> tuple[Axis, ...]:
        """The axes that split the world (degree > 1), in mesh order."""
        return tuple(a for a, n in self.items() if n > 1)

    @property
    def batch_split(self) -> int:
        """How many ways the batch is split: over dp, and over ep, whose ranks each route
        their own tokens (`BATCH_AXES`)."""
        return self["dp"] * self["ep"]

    def stride(self, axis: Axis | str) -> int:
        """The rank distance between neighbours on `axis`: the product of the degrees of
        the axes inside it in the mesh."""
        return math.prod(self.sizes[self._index(axis) + 1 :])

    def replace(self, **changes: int) -> Degrees:
        return Degrees({**dict(self.items()), **changes})

    def _index(self, axis: Axis | str) -> int:
        positions = _positions(self.axes)
        if axis in positions:  # an Axis hashes as its name
            return positions[axis]
        raise MeshError(f"unknown mesh axis {str(axis)!r}: the axes are {self.names}")

    @property
    def names(self) -> list[str]:
        return [str(a) for a in self.axes]

    # -- checking and enumerating -----------------------------------------------------

    def check_covers(self, world_size: int, where: str) -> None:
        """Fail clearly unless the degrees multiply to the `world_size` devices of `where`."""
        if self.world_size != world_size:
            raise MeshError(
                f"{self.product()} = {self.world_size} devices, but the mesh {where} has "
                f"{world_size}: choose axes whose product is {world_size}"
            )

    @classmethod
    def factorizations(
        cls, world_size: int, pinned: Mapping[Any, int] | None = None
    ) -> Iterator[Degrees]:
        """Every `Degrees` whose product is `world_size`, with the `pinned` axes fixed."""
        pinned = {str(a): n for a, n in (pinned or {}).items()}
        names = axis_names()

        def split(rest: int, i: int) -> Iterator[tuple[int, ...]]:
            if i == len(names) - 1:
                if pinned.get(names[i], rest) == rest:
                    yield (rest,)
                return
            for d in _divisors(rest):
                if pinned.get(names[i], d) == d:
                    for inner in split(rest // d, i + 1):
                        yield (d, *inner)

        for sizes in split(world_size, 0):
            # Checked by construction; a world of thousands has thousands of these.
            degrees = object.__new__(cls)
            object.__setattr__(degrees, "axes", MESH_AXES)
            object.__setattr__(degrees, "sizes", sizes)
            object.__setattr__(degrees, "_by_name", dict(zip(names, sizes)))
            yield degrees

    # -- the device mesh --------------------------------------------------------------

    def device_mesh(self, device_type: str, options: GroupOptions | None = None) -> DeviceMesh:
        """The named DeviceMesh of the running world, one dim per axis in mesh order;
        every axis's process group is made with `options` (its backend and timeout)."""
        override: dict[int | str, Any] | None = (
            {name: options for name in self.names} if options is not None else None
        )
        return init_device_mesh(
            device_type, self.sizes, mesh_dim_names=tuple(self.names), backend_override=override
        )

    # -- text and JSON ----------------------------------------------------------------

    def product(self) -> str:
        """The factorization as text: `pp×dp×tp = 2×4×2`."""
        return f"{'×'.join(self.names)} = {'×'.join(str(n) for n in self.sizes)}"

    def __str__(self) -> str:
        return " ".join(f"{a}={n}" for a, n in self.items())

    def __repr__(self) -> str:
        return f"Degrees({', '.join(f'{a}={n}' for a, n in self.items())})"

    def to_json(self) -> dict[str, int]:
        return dict(zip(self.names, self.sizes))

    @classmethod
    def from_json(cls, data: Mapping[str, int]) -> Degrees:
        return cls(data)


@functools.cache
def _positions(axes: tuple[Axis, ...]) -> dict[str, int]:
    # The search asks for strides hundreds of thousands of times.
    return {str(a): i for i, a in enumerate(axes)}


def axis_names() -> list[str]:
    """The names of the mesh axes, in mesh order."""
    return [str(a) for a in MESH_AXES]


class AxisAttributes:
    """`x.dp`, `x.tp`, ...: the degree of each mesh axis of `x.degrees`, by name: a
    property per axis known at import (the cost models read them millions of times a
    search), and any axis declared since (`MESH_AXES`) on the slower path."""

    __slots__ = ()

    def __getattr__(self, name: str) -> int:
        degrees: Degrees = object.__getattribute__(self, "degrees")
        try:
            return degrees[name]
        except MeshError:
            raise AttributeError(
                f"{type(self).__name__!r} object has no attribute {name!r}"
            ) from None


def _degree_of(name: str) -> property:
    return property(lambda self: self.degrees._by_name[name], doc=f"The degree of {name}.")


for _name in axis_names():
    setattr(AxisAttributes, _name, _degree_of(_name))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
