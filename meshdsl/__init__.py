"""meshdsl: Mesh-TensorFlow-style named tensors on JAX.

Write a model once with named dims, pick a mesh and a layout (which dim is split over which mesh
axis), and ``md.compile`` runs it with the collectives the layout needs. See docs/api.md.
"""

from typing import TYPE_CHECKING, Any

from meshdsl import checkpoint, nn, pipeline, random
from meshdsl.compile import Backend, Compiled, compile
from meshdsl.decoding import generate
from meshdsl.dims import Dim, Shape
from meshdsl.errors import (
    ConfigError,
    DataError,
    LayoutError,
    MeshDslError,
    ShapeError,
    UnsupportedJaxError,
    WriteError,
)
from meshdsl.explain import Communication, Report, explain
from meshdsl.layout import Layout
from meshdsl.lowering.context import use_layout
from meshdsl.mesh import Mesh
from meshdsl.ops.concat import concat, pad, slice, split, stack, unstack
from meshdsl.ops.conv import conv2d
from meshdsl.ops.creation import full, ones, zeros
from meshdsl.ops.einsum import einsum
from meshdsl.ops.elementwise import (
    abs,
    add,
    cast,
    cos,
    divide,
    equal,
    erf,
    exp,
    gelu,
    greater,
    greater_equal,
    less,
    less_equal,
    log,
    log_sigmoid,
    logical_and,
    logical_not,
    logical_or,
    map,  # noqa: A004  (md.map, as Python's)
    maximum,
    minimum,
    mod,
    multiply,
    negative,
    not_equal,
    power,
    relu,
    rsqrt,
    sigmoid,
    silu,
    sin,
    softplus,
    sqrt,
    square,
    stop_gradient,
    subtract,
    swish,
    tanh,
    where,
)
from meshdsl.ops.indexing import argmax, cumsum, gather, one_hot, range, shift, take_along, top_k
from meshdsl.ops.reduction import log_softmax, logsumexp, reduce_max, reduce_mean, reduce_min, reduce_sum, softmax
from meshdsl.ops.reshape import rearrange, rename, replace_dimensions, reshape, transpose
from meshdsl.ops.scan import scan
from meshdsl.random import dropout
from meshdsl.tensor import Tensor, tensor

__all__ = [
    "abs",
    "add",
    "argmax",
    "Backend",
    "cast",
    "checkpoint",
    "hf",
    "Communication",
    "compile",
    "Compiled",
    "concat",
    "ConfigError",
    "conv2d",
    "cos",
    "cumsum",
    "DataError",
    "Dim",
    "divide",
    "dropout",
    "einsum",
    "equal",
    "erf",
    "exp",
    "explain",
    "full",
    "gather",
    "gelu",
    "generate",
    "greater",
    "greater_equal",
    "Layout",
    "LayoutError",
    "less",
    "less_equal",
    "log",
    "log_sigmoid",
    "log_softmax",
    "logical_and",
    "logical_not",
    "logical_or",
    "logsumexp",
    "map",
    "maximum",
    "Mesh",
    "MeshDslError",
    "minimum",
    "mod",
    "multiply",
    "negative",
    "nn",
    "not_equal",
    "one_hot",
    "ones",
    "pad",
    "pipeline",
    "power",
    "random",
    "range",
    "rearrange",
    "reduce_max",
    "reduce_mean",
    "reduce_min",
    "reduce_sum",
    "relu",
    "rename",
    "replace_dimensions",
    "Report",
    "reshape",
    "rsqrt",
    "scan",
    "Shape",
    "ShapeError",
    "shift",
    "sigmoid",
    "silu",
    "sin",
    "slice",
    "softmax",
    "softplus",
    "split",
    "sqrt",
    "square",
    "stack",
    "stop_gradient",
    "subtract",
    "swish",
    "take_along",
    "tanh",
    "Tensor",
    "tensor",
    "top_k",
    "transpose",
    "UnsupportedJaxError",
    "unstack",
    "use_layout",
    "where",
    "WriteError",
    "zeros",
]


if TYPE_CHECKING:
    from meshdsl import hf as hf
else:

    def __getattr__(name: str) -> Any:
        """``md.hf``, imported on first use: it builds the shipped llama decoder, a module that itself imports
        ``meshdsl``, so importing it here, with the package, would make a circle of imports."""
        if name == "hf":
            import importlib

            return importlib.import_module("meshdsl.hf")
        raise AttributeError(f"module 'meshdsl' has no attribute {name!r}")
