"""This rank's place on the mesh: its coordinate and process group on each axis."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import GroupName
from torch.distributed.device_mesh import DeviceMesh

from autopart.degrees import BATCH_AXES, Axis, GroupOptions


@dataclass(frozen=True)
class MeshGroups:
    device_mesh: DeviceMesh
    # The backend and options (the timeout) of the groups the mesh was made with, for
    # the flattened ones made here.
    options: GroupOptions | None = None

    def mesh(self, *axes: Axis) -> DeviceMesh:
        """The mesh of one axis, or of several flattened into one dim: the ranks an
        operation that spans those axes runs over (flattened meshes are cached by
        the DeviceMesh)."""
        names = tuple(str(a) for a in axes)
        if len(names) == 1:
            return self.device_mesh[names[0]]
        # DeviceMesh has no public flatten yet; torchtitan builds its combined axes alike.
        return self.device_mesh[names]._flatten("_".join(names), backend_override=self.options)

    def group(self, *axes: Axis) -> dist.ProcessGroup:
        """The process group over `axes` (one axis, or several together)."""
        if len(axes) == 1:
            return self.device_mesh.get_group(str(axes[0]))
        return self.mesh(*axes).get_group()

    @property
    def timeout(self) -> timedelta | None:
        """How long a collective of these groups waits for its peers (None: the
        backend's default)."""
        return self.options[1]._timeout if self.options else None

    def group_name(self, *axes: Axis) -> GroupName:
        return self.group(*axes).group_name

    @property
    def batch_rank(self) -> int:
        """This rank's share of the batch, of `batch_size` (over dp × ep)."""
        return self.rank(Axis.DP) * self.size(Axis.EP) + self.rank(Axis.EP)

    @property
    def batch_size(self) -> int:
        """How many ways the batch is split (dp × ep)."""
        return self.size(Axis.DP) * self.size(Axis.EP)

    def batch_group(self) -> dist.ProcessGroup:
        """The ranks that split the batch with this one, and sync its replicated
        gradients: dp × ep."""
        return self.group(*BATCH_AXES) if self.size(Axis.EP) > 1 else self.group(Axis.DP)

    def rank(self, axis: Axis) -> int:
        return self.device_mesh.get_local_rank(str(axis))

    def size(self, axis: Axis) -> int:
        return self.device_mesh.size(self.mesh_dim(axis))

    def mesh_dim(self, axis: Axis) -> int:
        """The dim of the device mesh that `axis` names."""
        names = self.device_mesh.mesh_dim_names
        assert names is not None, "the device mesh names its dims (Degrees.device_mesh)"
        return names.index(str(axis))

    @property
    def device_type(self) -> str:
        return self.device_mesh.device_type

    @property
    def device(self) -> torch.device:
        """This rank's device: its GPU under NCCL, the CPU under Gloo."""
        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.device_type)

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh(Axis.TP)

    @property
    def is_last_stage(self) -> bool:
        return self.rank(Axis.PP) == self.size(Axis.PP) - 1

    @property
    def reports_loss(self) -> bool:
        """One rank per data-parallel replica holds the loss: tp and cp rank 0 of the
        last stage."""
        return self.is_last_stage and self.rank(Axis.TP) == 0 and self.rank(Axis.CP) == 0
