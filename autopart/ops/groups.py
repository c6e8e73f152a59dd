"""This rank's place on the mesh: its coordinate and process group on each axis."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autopart.mesh import Axis


@dataclass(frozen=True)
class MeshGroups:
    device_mesh: DeviceMesh

    def group(self, axis: Axis) -> dist.ProcessGroup:
        return self.device_mesh.get_group(axis.value)

    def group_name(self, axis: Axis) -> str:
        return self.group(axis).group_name

    def rank(self, axis: Axis) -> int:
        return self.device_mesh.get_local_rank(axis.value)

    def size(self, axis: Axis) -> int:
        return self.device_mesh.size(self.device_mesh.mesh_dim_names.index(axis.value))

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
        return self.device_mesh[Axis.TP.value]

    @property
    def is_last_stage(self) -> bool:
        return self.rank(Axis.PP) == self.size(Axis.PP) - 1

    @property
    def reports_loss(self) -> bool:
        """One rank per data-parallel replica holds the loss: tp rank 0 of the last stage."""
        return self.is_last_stage and self.rank(Axis.TP) == 0
