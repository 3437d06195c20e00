"""Component-wise ops, with broadcasting by dim name. No communication.

Operands line up by name: ``x[batch, d] + b[d]`` adds ``b`` to every row. The output's dims are
the union of the operands' dims in order of first appearance; a name with two sizes is a
ShapeError. Python scalars and 0-d arrays broadcast as usual.

Pending partial sums stay pending where the op is linear in them (``add``/``subtract`` of tensors
with the same pending axes, ``negative``, and ``multiply``/``divide`` by a factor not split over
those axes), so ``einsum(a, b) + einsum(c, d)`` over a split dim costs one ``psum``, not two.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshdsl.dims import Dim, Shape
from meshdsl.errors import ShapeError
from meshdsl.lowering.context import current, op_scope
from meshdsl.tensor import Tensor, describe, dtype_of


def _check_operand(x: Any, name: str) -> None:
    """An operand is an md tensor or a number (a Python number or a 0-d array)."""
    if isinstance(x, Tensor):
        return
    if isinstance(x, (bool, int, float, complex)):
        return
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        if len(x.shape):
            raise ShapeError(
                f"{name}: operand of shape {tuple(x.shape)} has no dim names; wrap it with md.tensor(array, dims)",
                op=name,
            )
        if (
            np.issubdtype(np.dtype(x.dtype), np.number)
            or np.dtype(x.dtype) == np.bool_
            or jnp.issubdtype(x.dtype, jnp.floating)
        ):
            return
    raise ShapeError(f"{name}: operand {describe(x)} is neither an md tensor nor a number", op=name)


def broadcast_shape(operands: Sequence[Any], name: str) -> Shape:
    """Union of the operands' dims by name, in order of first appearance."""
    dims: dict[str, Dim] = {}
    for x in operands:
        _check_operand(x, name)
        if isinstance(x, Tensor):
            for d in x.shape:
                if d.name in dims and dims[d.name].size != d.size:
                    shapes = ", ".join(str(t.shape) for t in operands if isinstance(t, Tensor))
                    raise ShapeError(
                        f"{name}: dim {d.name} has size {dims[d.name].size} in one operand and {d.size} in another "
                        f"({shapes})",
                        op=name,
                    )
                dims.setdefault(d.name, d)
    return Shape(dims.values())


def align(array: jax.Array, shape: Shape, out: Shape) -> jax.Array:
    """``array`` (dims ``shape``) transposed to ``out``'s order, with size-1 axes where it lacks a dim."""
    order = [n for n in out.names if n in shape]
    array = jnp.transpose(array, [shape.index(n) for n in order])
    return jnp.reshape(array, [array.shape[order.index(n)] if n in shape else 1 for n in out.names])


def _linear_pending(name: str, operands: Sequence[Any], lowering) -> tuple[str, ...]:
    """The pending sums the result may keep, or () if the operands must be summed first."""
    tensors = [x for x in operands if isinstance(x, Tensor)]
    pendings = {x.pending for x in tensors}
    if name in ("add", "subtract"):
        return tensors[0].pending if len(tensors) == len(operands) and len(pendings) == 1 else ()
    if name == "negative":
        return tensors[0].pending
    if name in ("multiply", "divide"):
        summed = [x for x in operands if isinstance(x, Tensor) and x.pending]
        if len(summed) != 1 or (name == "divide" and operands[0] is not summed[0]):
            return ()
        pending = summed[0].pending
        for x in tensors:
            if x is not summed[0]:
                split = {a for axes in lowering.split_of(x) for a in axes}
                if x.pending or split & set(pending):
                    return ()
        return pending
    return ()


def _map(name: str, fn: Callable[..., jax.Array], *operands: Any) -> Tensor:
    with op_scope(name):
        lowering = current()
        out = broadcast_shape(operands, name)
        tensors = [x for x in operands if isinstance(x, Tensor)]
        pending = _linear_pending(name, operands, lowering)
        splits = {lowering.split_of(x) for x in tensors}
        if not pending and len(splits) == 1 and all(x.shape == out and not x.pending for x in tensors):
            # Operands alike in shape and split (e.g. a parameter stored split for FSDP): stay there.
            args = [x._data if isinstance(x, Tensor) else x for x in operands]
            return lowering.keep(fn(*args), out, splits.pop())
        locals_ = []
        for x in operands:
            if isinstance(x, Tensor):
                data = x._data if x.pending and pending else lowering.prepare(x, beside=tensors)
                locals_.append(align(data, x.shape, out))
            else:
                locals_.append(x)
        return lowering.finish(fn(*locals_), out, pending=pending, lazy=True)


def check_float(name: str, x: Any) -> None:
    """The one rule of the float-only ops (exp, log, silu, ...: a value of no integer): a ShapeError
    for an integer or boolean md tensor, which jnp would promote (or, in jax.nn, refuse) unasked."""
    if isinstance(x, Tensor) and not jnp.issubdtype(x.dtype, jnp.inexact):
        raise ShapeError(
            f"{name}: takes floating-point input, got {x.shape} of {jnp.dtype(x.dtype).name}; "
            "md.cast(x, 'float32') it first"
        )


def _unary(
    name: str, fn: Callable[[jax.Array], jax.Array], doc: str, floats_only: bool = False
) -> Callable[[Tensor], Tensor]:
    def unary(x: Tensor) -> Tensor:
        if floats_only:
            check_float(name, x)
        return _map(name, fn, x)

    unary.__name__ = unary.__qualname__ = name
    unary.__doc__ = doc
    return unary


def _binary(name: str, fn: Callable[[Any, Any], jax.Array], doc: str) -> Callable[[Any, Any], Tensor]:
    def binary(x: Any, y: Any) -> Tensor:
        return _map(name, fn, x, y)

    binary.__name__ = binary.__qualname__ = name
    binary.__doc__ = doc
    return binary


exp = _unary("exp", jnp.exp, "e to the ``x``, element by element.", floats_only=True)
log = _unary("log", jnp.log, "Natural logarithm.", floats_only=True)
sqrt = _unary("sqrt", jnp.sqrt, "Square root.", floats_only=True)
rsqrt = _unary("rsqrt", jax.lax.rsqrt, "1 / sqrt(x).", floats_only=True)
tanh = _unary("tanh", jnp.tanh, "Hyperbolic tangent.", floats_only=True)
sigmoid = _unary("sigmoid", jax.nn.sigmoid, "1 / (1 + exp(-x)).", floats_only=True)
softplus = _unary("softplus", jax.nn.softplus, "log(1 + exp(x)), computed stably.", floats_only=True)
log_sigmoid = _unary(
    "log_sigmoid", jax.nn.log_sigmoid, "log(sigmoid(x)) = -softplus(-x), computed stably.", floats_only=True
)
relu = _unary("relu", jax.nn.relu, "max(x, 0).")
square = _unary("square", jnp.square, "x * x.")
abs = _unary("abs", jnp.abs, "Absolute value.")  # noqa: A001  (md.abs, as numpy)
negative = _unary("negative", jnp.negative, "-x.")
logical_not = _unary("logical_not", jnp.logical_not, "Boolean not.")
sin = _unary("sin", jnp.sin, "Sine (radians).", floats_only=True)
cos = _unary("cos", jnp.cos, "Cosine (radians).", floats_only=True)


@jax.custom_jvp
def _erf(a: jax.Array) -> jax.Array:
    """``lax.erf`` with its derivative written out: JAX 0.12's own derivative of erf builds constants
    that ``shard_map``'s varying-axes check rejects ("Primitive polynomial requires varying manual
    axes to match") inside the spmd lowering."""
    return jax.lax.erf(a)


@_erf.defjvp
def _erf_jvp(primals: tuple, tangents: tuple) -> tuple:
    (a,), (da,) = primals, tangents
    return _erf(a), da * (2 / math.sqrt(math.pi)) * jnp.exp(-a * a)


erf = _unary("erf", _erf, "The error function, 2 / sqrt(pi) * integral of exp(-t^2) from 0 to x.", floats_only=True)
silu = _unary("silu", jax.nn.silu, "x * sigmoid(x) (SiLU, also called swish): the gate of SwiGLU.", floats_only=True)
swish = silu

add = _binary("add", jnp.add, "x + y, broadcast by name.")
subtract = _binary("subtract", jnp.subtract, "x - y, broadcast by name.")
multiply = _binary("multiply", jnp.multiply, "x * y, broadcast by name.")
divide = _binary("divide", jnp.divide, "x / y, broadcast by name.")
power = _binary("power", jnp.power, "x ** y, broadcast by name.")
mod = _binary("mod", jnp.remainder, "x % y (sign of y, as Python), broadcast by name.")
maximum = _binary("maximum", jnp.maximum, "Element-wise larger of x and y.")
minimum = _binary("minimum", jnp.minimum, "Element-wise smaller of x and y.")
equal = _binary("equal", jnp.equal, "x == y (boolean).")
not_equal = _binary("not_equal", jnp.not_equal, "x != y (boolean).")
less = _binary("less", jnp.less, "x < y (boolean).")
less_equal = _binary("less_equal", jnp.less_equal, "x <= y (boolean).")
greater = _binary("greater", jnp.greater, "x > y (boolean).")
greater_equal = _binary("greater_equal", jnp.greater_equal, "x >= y (boolean).")
logical_and = _binary("logical_and", jnp.logical_and, "Boolean and.")
logical_or = _binary("logical_or", jnp.logical_or, "Boolean or.")


def gelu(x: Tensor, approximate: bool = True) -> Tensor:
    """Gaussian error linear unit (tanh approximation by default, as Mesh-TF)."""
    check_float("gelu", x)
    return _map("gelu", lambda a: jax.nn.gelu(a, approximate=approximate), x)


def map(fn: Callable[..., jax.Array], *operands: Any) -> Tensor:  # noqa: A001  (md.map, as Python's)
    """``fn`` applied element by element to ``operands`` (md tensors and numbers), broadcast by name.

    ``fn`` is any element-wise ``jnp`` function of as many arrays (``jnp.sin``, ``jax.nn.mish``,
    ``lambda a, b: a * jnp.cos(b)``). It runs on each device's aligned blocks, as ``md.add`` does
    (no communication when the operands share a layout); a pending sum is added first, since
    ``fn`` need not be linear. The result has the union of the operands' dims. An ``fn`` whose
    result is not the shape of its broadcast inputs is a ShapeError: it is not element-wise.
    """
    if not callable(fn):
        raise ShapeError(f"map: the function to apply must be callable, got {describe(fn)}", op="map")
    if not any(isinstance(x, Tensor) for x in operands):
        raise ShapeError("map: at least one operand must be an md tensor", op="map")
    label = getattr(fn, "__name__", "fn")

    def checked(*arrays: Any) -> jax.Array:
        result = jnp.asarray(fn(*arrays))
        want = jnp.broadcast_shapes(*(jnp.shape(a) for a in arrays))
        if result.shape != want:
            raise ShapeError(
                f"map: {label} turned blocks of shape {want} into {result.shape}; it must work element by element",
                op="map",
            )
        return result

    return _map("map", checked, *operands)


def cast(x: Tensor, dtype: Any) -> Tensor:
    """``x`` converted to ``dtype``."""
    dtype = dtype_of(dtype, "cast")
    return _map("cast", lambda a: a.astype(dtype), x)


def where(condition: Any, x: Any, y: Any) -> Tensor:
    """``x`` where ``condition`` holds, else ``y``; all three broadcast by name.

    ``condition`` is boolean (a comparison's result, or a Python bool): a number is no condition
    (``md.cast(c, bool)`` or ``c != 0`` says which entries hold).
    """
    _check_operand(condition, "where")
    kind = condition.dtype if isinstance(condition, Tensor) or hasattr(condition, "dtype") else type(condition)
    if not (kind is bool or (not isinstance(kind, type) and jnp.dtype(kind) == jnp.bool_)):
        name = jnp.dtype(kind).name if not isinstance(kind, type) else kind.__name__
        raise ShapeError(
            f"where: the condition must be boolean, got {name}; compare it (c != 0) or md.cast(c, bool)", op="where"
        )
    return _map("where", jnp.where, condition, x, y)


def stop_gradient(x: Tensor) -> Tensor:
    """``x``, with no gradient flowing back through it."""
    return _map("stop_gradient", jax.lax.stop_gradient, x)


__all__ = [
    "exp",
    "log",
    "sqrt",
    "rsqrt",
    "tanh",
    "sigmoid",
    "softplus",
    "log_sigmoid",
    "relu",
    "gelu",
    "square",
    "abs",
    "negative",
    "logical_not",
    "sin",
    "cos",
    "erf",
    "silu",
    "swish",
    "map",
    "add",
    "subtract",
    "multiply",
    "divide",
    "power",
    "mod",
    "maximum",
    "minimum",
    "equal",
    "not_equal",
    "less",
    "less_equal",
    "greater",
    "greater_equal",
    "logical_and",
    "logical_or",
    "cast",
    "where",
    "stop_gradient",
    "broadcast_shape",
    "align",
]
