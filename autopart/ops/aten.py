"""Naming operators the same way across front ends.

torch.export gives ATen overloads (`aten.linear.default`), fx.symbolic_trace gives torch
functions, methods and leaf modules (`nn.Linear`). `op_name` maps each to one short
name ("linear", "convolution", "add" ...), and the sets below classify those names.
"""

from __future__ import annotations

from torch import fx, nn
from torch._ops import HigherOrderOperator

_MODULE_OPS: dict[type[nn.Module], str] = {
    nn.Linear: "linear",
    nn.Conv1d: "convolution",
    nn.Conv2d: "convolution",
    nn.Conv3d: "convolution",
    nn.ConvTranspose1d: "conv_transpose",
    nn.ConvTranspose2d: "conv_transpose",
    nn.ConvTranspose3d: "conv_transpose",
    nn.Embedding: "embedding",
    nn.LayerNorm: "layer_norm",
    nn.BatchNorm1d: "batch_norm",
    nn.BatchNorm2d: "batch_norm",
    nn.BatchNorm3d: "batch_norm",
    nn.Dropout: "dropout",
    nn.ReLU: "relu",
    nn.GELU: "gelu",
    nn.SiLU: "silu",
    nn.Tanh: "tanh",
    nn.MaxPool2d: "max_pool2d",
    nn.AdaptiveAvgPool2d: "adaptive_avg_pool2d",
    nn.Flatten: "flatten",
    nn.Identity: "alias",
}

# Operators that only reinterpret, select or relabel memory: no FLOPs, no traffic.
VIEW_OPS = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape",
        "flatten",
        "unflatten",
        "squeeze",
        "unsqueeze",
        "transpose",
        "t",
        "permute",
        "expand",
        "expand_as",
        "slice",
        "select",
        "alias",
        "detach",
        "split",
        "split_with_sizes",
        "chunk",
        "unbind",
        "getitem",
        "narrow",
        "as_strided",
        "view_as",
        "contiguous",
        "size",
        "sym_size",
        "dim",
        "numel",
        "_assert_tensor_metadata",
        "_assert_scalar",
        "sym_constrain_range_for_size",
        "lift_fresh_copy",
        "movedim",
        "swapaxes",
    }
)

# Operators that move data without arithmetic: traffic but no FLOPs.
DATA_MOVEMENT_OPS = frozenset(
    {
        "embedding",
        "index",
        "index_select",
        "gather",
        "scatter",
        "cat",
        "stack",
        "clone",
        "copy",
        "copy_",
        "to",
        "_to_copy",
        "type_as",
        "repeat",
        "new_ones",
        "new_zeros",
        "zeros",
        "ones",
        "full",
        "zeros_like",
        "ones_like",
        "full_like",
        "empty",
        "arange",
        "slice_scatter",
        "select_scatter",
        "index_put",
        "masked_fill",
        "tril",
        "triu",
        "pad",
        "constant_pad_nd",
        "roll",
        "flip",
        "dropout",
        "float",
        "half",
        "bfloat16",
    }
)

# Operators whose work is proportional to their input rather than their output.
REDUCTION_OPS = frozenset(
    {
        "sum",
        "mean",
        "amax",
        "amin",
        "max",
        "min",
        "var",
        "std",
        "norm",
        "argmax",
        "argmin",
        "logsumexp",
        "prod",
        "var_mean",
        "cumsum",
        "any",
        "all",
    }
)

MATMUL_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "einsum"})
# Products of rows sorted by expert with weights stacked by expert, [E, in, out]: each
# run of rows (ending at cumulative offsets) by its own expert's matrix.
GROUPED_MM_OPS = frozenset({"grouped_mm_fallback", "_grouped_mm", "grouped_mm"})
# Products of activations by a weight, whose output dim a column-parallel layout shards.
WEIGHT_PRODUCTS = frozenset({"linear", "addmm", "mm", "matmul"}) | GROUPED_MM_OPS
ATTENTION_OPS = frozenset(
    {
        "scaled_dot_product_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    }
)


# Spellings of one operator across ATen and torch.nn.functional.
_ALIASES = {
    "conv1d": "convolution",
    "conv2d": "convolution",
    "conv3d": "convolution",
    "conv_transpose1d": "conv_transpose",
    "conv_transpose2d": "conv_transpose",
    "conv_transpose3d": "conv_transpose",
}


def op_name(node: fx.Node, gm: fx.GraphModule | None = None) -> str:
    """A short operator name for a call node; "" for placeholders, attributes and output."""
    name = _raw_op_name(node, gm)
    return _ALIASES.get(name, name)


def _raw_op_name(node: fx.Node, gm: fx.GraphModule | None) -> str:
    target = node.target
    if node.op == "call_function":
        packet = getattr(target, "overloadpacket", None)
        if packet is not None:
            return packet.__name__
        if isinstance(target, HigherOrderOperator):
            return target.name()
        return getattr(target, "__name__", str(target)).strip("_")
    if node.op == "call_method":
        return str(target)
    if node.op == "call_module" and gm is not None:
        module = gm.get_submodule(str(target))
        for cls in type(module).__mro__:
            if cls in _MODULE_OPS:
                return _MODULE_OPS[cls]
        return type(module).__name__
    return ""
