"""Cost models: what an operator, a collective, a rank's memory and a pipeline cost.

Plain objects passed explicitly (no module state): `ComputeModel` (a roofline per
operator), `CommModel` (alpha-beta collectives on the mesh's topology), `MemoryModel`
(ZeRO stages, schedules, recomputation), the pipeline formulas, and `predict`, which
combines them into a plan's `Predicted` figures.
"""

from autopart.cost_models.choices import Choices, CostModels
from autopart.cost_models.comm import COLLECTIVES, CommModel, ring_steps, ring_volume
from autopart.cost_models.compute import ComputeModel, PhaseCost, training_flops
from autopart.cost_models.memory import (
    MemoryModel,
    in_flight_microbatches,
    model_state_bytes,
)
from autopart.cost_models.pipeline import bubble_fraction, exposed_sync, pipeline_step
from autopart.cost_models.predict import predict, step_time_lower_bound
from autopart.cost_models.summary import GraphSummary
from autopart.cost_models.work import NodeWork, node_work

__all__ = [
    "COLLECTIVES",
    "Choices",
    "CommModel",
    "ComputeModel",
    "CostModels",
    "GraphSummary",
    "MemoryModel",
    "NodeWork",
    "PhaseCost",
    "bubble_fraction",
    "exposed_sync",
    "in_flight_microbatches",
    "model_state_bytes",
    "node_work",
    "pipeline_step",
    "predict",
    "ring_steps",
    "ring_volume",
    "step_time_lower_bound",
    "training_flops",
]
