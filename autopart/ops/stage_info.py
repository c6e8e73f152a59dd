"""What the runtime knows of a pipeline stage beyond its graph.

The pipeline split (passes/pipeline_split.py) writes a `PipelineInfo` into each stage
module's `gm.meta`; the pipeline runtime and the ZeRO-3 pass read it back.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx
from torch.utils import _pytree as pytree

from autopart.ops.meta import AnalysisMissing, NodeShape

PIPELINE_KEY = "autopart.pipeline"


@dataclass(frozen=True, slots=True)
class SharedParameter:
    """A parameter read by several stages: `owner` holds it, `readers` hold replicas."""

    fqn: str
    owner: int
    readers: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PipelineInfo:
    """What the runtime needs to know of a stage beyond its graph."""

    stage: int
    stages: int
    # The model's (flattened) inputs: binding their named dims to a microbatch's sizes
    # gives every stage's input and output shapes.
    model_inputs: tuple[NodeShape, ...]
    input_grads: tuple[bool, ...]  # which inputs carry a gradient back to the previous stage
    output_grads: tuple[bool, ...]  # which (flattened) outputs receive one
    shared: tuple[SharedParameter, ...]  # of the whole pipeline, the same in every stage


def pipeline_info(gm: fx.GraphModule) -> PipelineInfo:
    try:
        return gm.meta[PIPELINE_KEY]
    except KeyError:
        raise AnalysisMissing(
            f"{type(gm).__name__} is not a pipeline stage: run split_stages first"
        ) from None


def output_values(graph: fx.Graph) -> list[fx.Node]:
    """The values a graph returns, flattened."""
    (output,) = graph.find_nodes(op="output")
    return [v for v in pytree.tree_leaves(output.args[0]) if isinstance(v, fx.Node)]
