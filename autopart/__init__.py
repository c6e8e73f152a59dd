"""autopart: a compiler for distributed PyTorch training.

capture (torch.export) → analysis passes → solver → rewrite passes → runtime.
"""

from autopart.api import parallelize, plan
from autopart.batch import BatchError
from autopart.capture import CaptureError, capture
from autopart.compile import backend, clip_grad_norm_, gathered
from autopart.degrees import Axis, Degrees, MeshError
from autopart.mesh import DeviceSpec, Mesh
from autopart.plan import Plan, PlanError
from autopart.runtime.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from autopart.runtime.export import export
from autopart.runtime.parallel_module import ParallelModule
from autopart.runtime.weights import init_empty_weights
from autopart.verify import verify

__all__ = [
    "Axis",
    "BatchError",
    "CaptureError",
    "CheckpointError",
    "Degrees",
    "DeviceSpec",
    "Mesh",
    "MeshError",
    "ParallelModule",
    "Plan",
    "PlanError",
    "backend",
    "capture",
    "clip_grad_norm_",
    "export",
    "gathered",
    "init_empty_weights",
    "load_checkpoint",
    "parallelize",
    "plan",
    "save_checkpoint",
    "verify",
]
