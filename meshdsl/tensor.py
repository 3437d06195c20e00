"""Named tensors: a JAX array plus the names and sizes of its dims.

A :class:`Tensor` is a JAX pytree whose one leaf is the array and whose static part is the
:class:`~meshdsl.dims.Shape`, so ``jax.jit``, ``jax.grad``, ``jax.tree_util`` and optax handle it
like any array container. Outside ``md.compile`` the array is the global value. Inside the spmd
lowering it is this device's shard (the shape stays global): ``split`` records how it is split
(per dim, the mesh axes), and it may hold partial sums over some mesh axes that a later op adds
up (Mesh-TF's LazyAllreduceSum); reading ``.array`` adds them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshdsl.dims import Dim, Shape, ShapeLike, as_shape
from meshdsl.errors import ShapeError


def _binary(name: str, reflected: bool = False) -> Callable[[Tensor, Any], Tensor]:
    """The operator method that calls ``elementwise.<name>`` (``x + y`` is ``md.add(x, y)``); ``reflected`` swaps
    the operands, for ``2 * x``. Written as class attributes so that type checkers see the operators."""

    def method(self: Tensor, other: Any) -> Tensor:
        from meshdsl.ops import elementwise

        fn = getattr(elementwise, name)
        return fn(other, self) if reflected else fn(self, other)

    method.__name__ = f"__{'r' if reflected else ''}{name}__"
    return method


@jax.tree_util.register_pytree_with_keys_class
class Tensor:
    """A JAX array with named dims. Build one with :func:`tensor`."""

    __slots__ = ("_data", "shape", "pending", "split")
    __array_priority__ = 100
    __hash__ = None  # type: ignore[assignment]  # == is elementwise, as for arrays

    def __init__(
        self,
        data: Any,
        shape: Shape,
        pending: tuple[str, ...] = (),
        split: tuple[tuple[str, ...], ...] | None = None,
    ):
        self._data = data
        self.shape = shape
        self.pending = pending
        self.split = split

    @property
    def array(self) -> jax.Array:
        """The underlying array: the global value outside ``md.compile``, the local shard inside the spmd lowering."""
        if self.pending:
            from meshdsl.lowering.context import current, op_scope

            with op_scope("array"):
                return current().prepare(self)
        return self._data

    @property
    def dtype(self) -> jnp.dtype:
        return self._data.dtype

    @property
    def names(self) -> tuple[str, ...]:
        return self.shape.names

    def numpy(self) -> np.ndarray:
        """The global value as a numpy array, axes in ``self.shape`` order."""
        return np.asarray(self.array)

    def tree_flatten_with_keys(self):
        return ((jax.tree_util.GetAttrKey("array"), self._data),), (self.shape, self.pending, self.split)

    def tree_flatten(self):
        return (self._data,), (self.shape, self.pending, self.split)

    @classmethod
    def tree_unflatten(cls, aux: tuple, children: Sequence[Any]) -> Tensor:
        return cls(children[0], *aux)

    def __repr__(self) -> str:
        dtype = getattr(self._data, "dtype", None)
        return f"Tensor({self.shape}, dtype={dtype})"

    def __bool__(self) -> bool:
        """The truth value of a 0-d tensor; for more dims, a ShapeError (as numpy, which also refuses)."""
        if self.shape.rank:
            raise ShapeError(
                f"the truth value of an md tensor {self.shape} is ambiguous; reduce it first (md.reduce_max, "
                "md.reduce_min)"
            )
        return bool(self.array)

    def __neg__(self) -> Tensor:
        from meshdsl.ops import elementwise

        return elementwise.negative(self)

    def __abs__(self) -> Tensor:
        from meshdsl.ops import elementwise

        return elementwise.abs(self)

    def __invert__(self) -> Tensor:
        from meshdsl.ops import elementwise

        return elementwise.logical_not(self)

    __add__ = _binary("add")
    __radd__ = _binary("add", reflected=True)
    __sub__ = _binary("subtract")
    __rsub__ = _binary("subtract", reflected=True)
    __mul__ = _binary("multiply")
    __rmul__ = _binary("multiply", reflected=True)
    __truediv__ = _binary("divide")
    __rtruediv__ = _binary("divide", reflected=True)
    __pow__ = _binary("power")
    __rpow__ = _binary("power", reflected=True)
    __mod__ = _binary("mod")
    __rmod__ = _binary("mod", reflected=True)
    __and__ = _binary("logical_and")
    __rand__ = _binary("logical_and", reflected=True)
    __or__ = _binary("logical_or")
    __ror__ = _binary("logical_or", reflected=True)
    __lt__ = _binary("less")
    __le__ = _binary("less_equal")
    __gt__ = _binary("greater")
    __ge__ = _binary("greater_equal")
    # Element-wise, as numpy's arrays: a tensor of booleans, not object's bool.
    __eq__ = _binary("equal")  # type: ignore[assignment]
    __ne__ = _binary("not_equal")  # type: ignore[assignment]


def is_tensor(x: Any) -> bool:
    """Whether ``x`` is an md tensor: the ``is_leaf`` that keeps md tensors whole in ``jax.tree_util`` walks."""
    return isinstance(x, Tensor)


def describe(x: Any) -> str:
    """``x`` for an error message: an md tensor's shape, an array's dtype and sizes, else its type
    and value (never a JAX tracer's internals)."""
    if isinstance(x, Tensor):
        return f"an md tensor {x.shape} of {x.dtype}"
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"an array {np.dtype(x.dtype).name}[{', '.join(map(str, x.shape))}] without dim names"
    text = repr(x)
    return f"{type(x).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def dtype_of(dtype: Any, what: str) -> np.dtype:
    """``dtype`` as a numpy dtype; a ShapeError naming ``what`` if it is none."""
    try:
        return jnp.dtype(dtype)
    except TypeError:
        raise ShapeError(
            f"{what}: {dtype!r} is not a dtype (e.g. jnp.float32, 'bfloat16', 'int32')", op=what.removeprefix("md.")
        ) from None


def tensor(array: Any, dims: ShapeLike | str | Sequence[str]) -> Tensor:
    """A :class:`Tensor` from an array and its dims.

    ``dims`` is a list of :class:`Dim` (sizes checked against the array), a :class:`Shape`,
    a list of names, or a space-separated string of names (sizes taken from the array).
    """
    if not isinstance(array, jax.Array):
        array = _as_array(array)
    if isinstance(dims, str):
        dims = dims.split()
    if not isinstance(dims, (Dim, Shape, list, tuple)):
        raise ShapeError(
            f"md.tensor: dims must be md.Dims, a Shape, names or a string of names, got {describe(dims)}", op="tensor"
        )
    dims = [dims] if isinstance(dims, Dim) else list(dims.dims if isinstance(dims, Shape) else dims)
    if len(dims) != array.ndim:
        raise ShapeError(
            f"array of shape {tuple(array.shape)} has {array.ndim} axes, but {len(dims)} dims were named: {dims}"
        )
    resolved: list[Dim] = []
    for d, n in zip(dims, array.shape):
        if isinstance(d, str):
            d = Dim(d, n)
        elif not isinstance(d, Dim):
            raise ShapeError(f"a dim is an md.Dim or a name, got {d!r}")
        elif d.size != n:
            raise ShapeError(
                f"dim {d} does not match the array, whose axis {len(resolved)} has size {n} (array shape "
                f"{tuple(array.shape)})"
            )
        resolved.append(d)
    return Tensor(array, as_shape(resolved))


def _as_array(data: Any) -> jax.Array:
    """``data`` (numbers, nested lists, a numpy array) as a JAX array; ShapeError for what is not numbers,
    and for integers that JAX's integer type would wrap (int64 values beyond int32 without
    ``jax_enable_x64``: an id 2**40 would silently become 0)."""
    try:
        host = np.asarray(data)
    except (TypeError, ValueError, OverflowError):
        host = None
    if host is None:
        raise ShapeError(f"md.tensor: {describe(data)} is not an array of numbers", op="tensor")
    target = jax.dtypes.canonicalize_dtype(host.dtype) if host.dtype.kind in "iu" else host.dtype
    if host.size and np.dtype(target).itemsize < host.dtype.itemsize:
        info = np.iinfo(target)
        lo, hi = host.min(), host.max()
        if lo < info.min or hi > info.max:
            bad = hi if hi > info.max else lo
            raise ShapeError(
                f"md.tensor: value {bad} does not fit {np.dtype(target).name}, the integer type JAX uses here (range "
                f"{info.min}..{info.max}; jax_enable_x64 is off), so it would wrap; keep ids and counts in that range",
                op="tensor",
            )
    try:
        return jnp.asarray(host)
    except TypeError:
        raise ShapeError(f"md.tensor: {describe(data)} is not an array of numbers", op="tensor") from None
