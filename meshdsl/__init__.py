"""meshdsl: Mesh-TensorFlow-style named tensors on JAX."""

from meshdsl import random
from meshdsl.compile import Backend, Compiled, compile
from meshdsl.dims import Dim, Shape
from meshdsl.explain import Communication, Report, explain
from meshdsl.errors import LayoutError, MeshDslError, ShapeError
from meshdsl.layout import Layout
from meshdsl.mesh import Mesh
from meshdsl.ops.einsum import einsum
from meshdsl.ops.elementwise import (
    abs, add, cast, divide, equal, exp, gelu, greater, greater_equal, less, less_equal, log, logical_and,
    logical_not, logical_or, maximum, minimum, multiply, negative, not_equal, power, relu, rsqrt, sigmoid,
    sqrt, square, stop_gradient, subtract, tanh, where,
)
from meshdsl.ops.reduction import log_softmax, logsumexp, reduce_max, reduce_mean, reduce_min, reduce_sum, softmax
from meshdsl.tensor import Tensor, tensor
