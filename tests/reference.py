"""Independent references: arrays with dim names, broadcasting by name, in numpy or jax.numpy.

The harness checks meshdsl against functions written with these helpers. They share no code
with meshdsl: broadcasting by name, reductions and einsum are re-implemented here in a few
lines on plain arrays. A reference runs twice: in numpy on float64 copies of the inputs (the
forward reference), and in jax.numpy on float32 arrays on one device, under ``jax.grad`` (the
gradient reference). Every helper picks its array module from its inputs (:func:`xp_of`), so
one reference function serves both.

Writing a reference: take :class:`Named` inputs (``x.array``, ``x.names``), return a
:class:`Named` or a pytree (tuple, list, dict) of them, with dims in the order meshdsl
documents for the op's result; the harness compares names, order and values. For example::

    def ref(x, w):  # md.relu(md.einsum(x, w, out="batch d_ff")) + 1
        return R.relu(R.einsum("batch d_ff", x, w)) + 1

Each Named built while :func:`recording` is active is recorded, so the harness knows every
intermediate shape and can tell in advance whether a layout is legal for the program.
"""

from __future__ import annotations

import contextlib
import math
import string
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_recorded: list[Named] | None = None


@contextlib.contextmanager
def recording() -> Iterator[list[Named]]:
    """Collect every Named built inside the block (the reference's intermediates and results)."""
    global _recorded
    outer, _recorded = _recorded, []
    try:
        yield _recorded
    finally:
        _recorded = outer


def xp_of(*values: Any):
    """jax.numpy if any value is a jax array (or tracer), else numpy."""
    for v in values:
        a = v.array if isinstance(v, Named) else v
        if isinstance(a, jax.Array):
            return jnp
    return np


class Named:
    """An array whose axes have names. ``Named(a, "batch d")`` or ``Named(a, ["batch", "d"])``."""

    __slots__ = ("array", "names")
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, array: Any, names: str | Iterable[str]):
        names = tuple(names.split()) if isinstance(names, str) else tuple(names)
        if xp_of(array) is np:
            array = np.asarray(array)
        if array.ndim != len(names) or len(set(names)) != len(names):
            raise ValueError(f"Named: array of shape {array.shape} with names {names}")
        self.array = array
        self.names = names
        if _recorded is not None:
            _recorded.append(self)

    @property
    def sizes(self) -> dict[str, int]:
        return dict(zip(self.names, self.array.shape))

    def to(self, names: str | Sequence[str]) -> Named:
        """The same array with its axes permuted to ``names``."""
        names = tuple(names.split()) if isinstance(names, str) else tuple(names)
        if sorted(names) != sorted(self.names):
            raise ValueError(f"cannot permute {self.names} to {names}")
        xp = xp_of(self)
        return Named(xp.transpose(self.array, [self.names.index(n) for n in names]), names)

    def __repr__(self) -> str:
        return f"Named({self.sizes}, dtype={self.array.dtype})"

    # Arithmetic broadcasts by name, like md tensors.
    def __add__(self, o):
        return lift(lambda xp, a, b: a + b)(self, o)

    def __radd__(self, o):
        return lift(lambda xp, a, b: a + b)(o, self)

    def __sub__(self, o):
        return lift(lambda xp, a, b: a - b)(self, o)

    def __rsub__(self, o):
        return lift(lambda xp, a, b: a - b)(o, self)

    def __mul__(self, o):
        return lift(lambda xp, a, b: a * b)(self, o)

    def __rmul__(self, o):
        return lift(lambda xp, a, b: a * b)(o, self)

    def __truediv__(self, o):
        return lift(lambda xp, a, b: a / b)(self, o)

    def __rtruediv__(self, o):
        return lift(lambda xp, a, b: a / b)(o, self)

    def __pow__(self, o):
        return lift(lambda xp, a, b: a**b)(self, o)

    def __neg__(self):
        return lift(lambda xp, a: -a)(self)


def union_names(*operands: Any) -> tuple[str, ...]:
    """Dim names of the operands, in order of first appearance; a name with two sizes is an error."""
    sizes: dict[str, int] = {}
    for x in operands:
        if isinstance(x, Named):
            for n, s in x.sizes.items():
                if sizes.setdefault(n, s) != s:
                    raise ValueError(f"dim {n} has sizes {sizes[n]} and {s}")
    return tuple(sizes)


def expand(x: Named, names: Sequence[str]) -> Any:
    """``x``'s array with axes in ``names`` order and size-1 axes for the names it lacks."""
    xp = xp_of(x)
    order = [n for n in names if n in x.names]
    a = xp.transpose(x.array, [x.names.index(n) for n in order])
    return xp.reshape(a, [x.sizes[n] if n in x.names else 1 for n in names])


def lift(fn: Callable[..., Any]) -> Callable[..., Named]:
    """``fn(xp, *arrays)`` as a function of Named (broadcast by name) and scalar operands."""

    def apply(*operands: Any) -> Named:
        xp = xp_of(*operands)
        names = union_names(*operands)
        arrays = [expand(x, names) if isinstance(x, Named) else x for x in operands]
        out = fn(xp, *arrays)
        return Named(xp.broadcast_to(out, [_size(names, operands, n) for n in names]), names)

    return apply


def _size(names: Sequence[str], operands: Sequence[Any], name: str) -> int:
    for x in operands:
        if isinstance(x, Named) and name in x.names:
            return x.sizes[name]
    raise AssertionError(name)


def _stop_gradient(xp, a):
    return jax.lax.stop_gradient(a) if xp is jnp else a


def _sigmoid(xp, a):
    """1 / (1 + exp(-a)), written as (1 + tanh(a / 2)) / 2: no exp to overflow, forward or backward."""
    return 0.5 * (1 + xp.tanh(0.5 * a))


GELU_LINEAR_BEYOND = 10.0
"""Beyond ``|a| = 10`` the tanh in gelu is +-1 to float64 precision (its argument exceeds 43), so gelu
is ``max(a, 0)`` there exactly; and the cubic, which overflows float32 near ``|a| = 7e12``, is never
evaluated on such inputs."""


def _gelu(xp, a):
    """The tanh approximation (as Mesh-TF and jax.nn.gelu(approximate=True)), finite for every finite input.

    The formula runs on ``a`` where ``|a| < 10`` and on 0 elsewhere, and is used only inside (see
    :data:`GELU_LINEAR_BEYOND`), so neither branch of the ``where`` makes an inf or a NaN whose
    zero cotangent would still poison the gradient.
    """
    inside = xp.abs(a) < GELU_LINEAR_BEYOND
    c = xp.where(inside, a, 0 * a)
    formula = 0.5 * c * (1 + xp.tanh(math.sqrt(2 / math.pi) * (c + 0.044715 * c**3)))
    return xp.where(inside, formula, xp.where(a > 0, a, 0 * a))


def _softplus(xp, a):
    """log(1 + exp(a)) as logaddexp(0, a): exact for large |a| both ways, and so is its gradient."""
    return xp.logaddexp(xp.zeros_like(a), a)


# Component-wise functions, written out from their definitions, each finite (with a finite
# gradient) for every finite input where the function itself is finite: tests/test_reference.py
# checks them on extreme inputs.
exp = lift(lambda xp, a: xp.exp(a))
log = lift(lambda xp, a: xp.log(a))
sqrt = lift(lambda xp, a: xp.sqrt(a))
rsqrt = lift(lambda xp, a: 1 / xp.sqrt(a))
tanh = lift(lambda xp, a: xp.tanh(a))
sigmoid = lift(_sigmoid)
softplus = lift(_softplus)
log_sigmoid = lift(lambda xp, a: -_softplus(xp, -a))
relu = lift(lambda xp, a: xp.where((a > 0) | xp.isnan(a), a, xp.zeros_like(a)))  # relu(-inf) is 0, relu(NaN) NaN
gelu = lift(_gelu)
square = lift(lambda xp, a: a * a)
abs = lift(lambda xp, a: xp.abs(a))  # noqa: A001
negative = lift(lambda xp, a: -a)
stop_gradient = lift(_stop_gradient)
maximum = lift(lambda xp, a, b: xp.maximum(a, b))
minimum = lift(lambda xp, a, b: xp.minimum(a, b))
power = lift(lambda xp, a, b: a**b)
where = lift(lambda xp, c, a, b: xp.where(c, a, b))
less = lift(lambda xp, a, b: a < b)
less_equal = lift(lambda xp, a, b: a <= b)
greater = lift(lambda xp, a, b: a > b)
greater_equal = lift(lambda xp, a, b: a >= b)
equal = lift(lambda xp, a, b: a == b)
not_equal = lift(lambda xp, a, b: a != b)
logical_and = lift(lambda xp, a, b: xp.logical_and(a, b))
logical_or = lift(lambda xp, a, b: xp.logical_or(a, b))
logical_not = lift(lambda xp, a: xp.logical_not(a))


def cast(x: Named, dtype: Any) -> Named:
    return lift(lambda xp, a: a.astype(dtype))(x)


def _dims(x: Named, dims: str | Iterable[str] | None) -> tuple[str, ...]:
    if dims is None:
        return x.names
    return tuple(dims.split()) if isinstance(dims, str) else tuple(dims)


def reduce(kind: str, x: Named, dims: str | Iterable[str] | None = None) -> Named:
    """``kind`` in sum, mean, max, min over the named dims (None: all); the others keep their order."""
    xp = xp_of(x)
    dims = _dims(x, dims)
    axes = tuple(x.names.index(d) for d in dims)
    names = [n for n in x.names if n not in dims]
    if kind in ("max", "min"):
        return Named(_extremum(xp, x.array, axes, kind), names)
    fn = {"sum": xp.sum, "mean": xp.mean}[kind]
    return Named(xp.asarray(fn(x.array, axis=axes)), names)


def _extremum(xp, a: Any, axes: tuple[int, ...], kind: str) -> Any:
    """The largest (smallest) entry over ``axes``, taken by its index: its derivative is the entry's,
    as at a strict extremum (the generator keeps extrema distinct). Not ``jnp.max``'s derivative,
    which finds the entries equal to the maximum by comparing bit for bit: under ``jax.jit`` XLA may
    recompute the operand inside each fusion that reads it, rounding differently, and then finds
    no entry or the wrong ones (seen with XLA of jaxlib 0.12 on a ``lax.scan`` 's stacked outputs in
    float64: the seed-3067 program of tests/test_programs.py)."""
    keep = [i for i in range(a.ndim) if i not in axes]
    moved = xp.transpose(a, keep + list(axes))
    flat = moved.reshape(moved.shape[: len(keep)] + (-1,))
    pick = xp.argmax(flat, axis=-1) if kind == "max" else xp.argmin(flat, axis=-1)
    return xp.asarray(xp.take_along_axis(flat, pick[..., None], axis=-1)[..., 0])


_finite_or_zero = lift(lambda xp, a: xp.where(xp.isfinite(a), a, xp.zeros_like(a)))


def logsumexp(x: Named, dims: str | Iterable[str] | None = None) -> Named:
    """As ``jax.nn.logsumexp`` and ``scipy.special.logsumexp``: a maximum that is not finite (a row of
    ``-inf``) shifts by 0, so such a row gives ``-inf``."""
    top = stop_gradient(_finite_or_zero(reduce("max", x, dims)))
    return log(reduce("sum", exp(x - top), dims)) + top


def softmax(x: Named, dims: str | Iterable[str]) -> Named:
    e = exp(x - stop_gradient(reduce("max", x, dims)))
    return e / reduce("sum", e, dims)


def log_softmax(x: Named, dims: str | Iterable[str]) -> Named:
    """As ``jax.nn.log_softmax``: a row holding NaN or +inf is NaN throughout."""
    shifted = x - stop_gradient(reduce("max", x, dims))
    return shifted - log(reduce("sum", exp(shifted), dims))


def einsum(out: str | Sequence[str], *xs: Named) -> Named:
    """Product of ``xs`` summed over every dim not in ``out`` (space-separated names or a list)."""
    out = tuple(out.split()) if isinstance(out, str) else tuple(out)
    union_names(*xs)  # sizes must agree
    if len(xs) > 2 and (paired := _pairwise_einsum(out, xs)) is not None:
        return paired
    # As jnp.einsum: a dim in one operand alone (and not in out) is summed before any product, which
    # decides NaN against inf: inf * (0 + 3) is inf, inf * 0 + inf * 3 NaN.
    counts = {n: sum(n in x.names for x in xs) for x in xs for n in x.names}
    xs = tuple(
        reduce("sum", x, lone) if (lone := [n for n in x.names if counts[n] == 1 and n not in out]) else x for x in xs
    )
    letters = {n: string.ascii_letters[i] for i, n in enumerate(dict.fromkeys(n for x in xs for n in x.names))}
    spec = ",".join("".join(letters[n] for n in x.names) for x in xs) + "->" + "".join(letters[n] for n in out)
    xp = xp_of(*xs)
    return Named(xp.einsum(spec, *(x.array for x in xs)), out)


def _pairwise_einsum(out: tuple[str, ...], xs: Sequence[Named]) -> Named | None:
    """Three or more operands contracted two at a time, in the order ``jnp.einsum`` takes on these
    global shapes (opt_einsum's path), each pair's summed dims added before the next product: the
    order decides NaN against inf where an inf meets a zero. None where the path contracts three
    or more at once (so does jnp)."""
    sizes = {n: s for x in xs for n, s in x.sizes.items()}
    letters = {n: string.ascii_letters[i] for i, n in enumerate(sizes)}
    spec = ",".join("".join(letters[n] for n in x.names) for x in xs) + "->" + "".join(letters[n] for n in out)
    shapes = [jax.ShapeDtypeStruct(tuple(sizes[n] for n in x.names), np.float32) for x in xs]
    path = jnp.einsum_path(spec, *shapes, optimize="auto")[0]
    if any(len(step) > 2 for step in path):
        return None
    ops = list(xs)
    for step in path:
        picked = [ops[i] for i in sorted(step)]
        for i in sorted(step, reverse=True):
            ops.pop(i)
        needed = {n for x in ops for n in x.names} | set(out)
        ops.append(einsum([n for n in dict.fromkeys(n for x in picked for n in x.names) if n in needed], *picked))
    (result,) = ops
    return result.to(out)


# ---- reshapes, cuts and index ops (test_reshape, test_concat, test_indexing, test_scan) ----
#
# Written from the ops' documented meaning on whole arrays: a reshape reads the data row-major,
# a shift is ``out[i] = x[i - offset]``, an out-of-range gather index gives zeros, top_k breaks
# ties towards the lower index (a stable sort), argmax returns the first maximum.


def _axis(x: Named, dim: str) -> int:
    return x.names.index(dim)


def reshape(x: Named, dims: Sequence[tuple[str, int]] | dict) -> Named:
    """``x``'s data read row-major as the dims ``dims`` (``[(name, size), ...]`` or a dict)."""
    items = list(dims.items()) if isinstance(dims, dict) else list(dims)
    xp = xp_of(x)
    return Named(xp.reshape(x.array, [s for _, s in items]), [n for n, _ in items])


def rename(x: Named, old: str, new: str) -> Named:
    return Named(x.array, [new if n == old else n for n in x.names])


def concat(xs: Sequence[Named], dim: str) -> Named:
    """Join along ``dim``; the other operands are first permuted to the first one's dim order."""
    first = xs[0]
    xp = xp_of(*xs)
    arrays = [x.to(first.names).array for x in xs]
    return Named(xp.concatenate(arrays, axis=_axis(first, dim)), first.names)


def slice_(x: Named, begin: int, size: int, dim: str) -> Named:
    index = [slice(None)] * len(x.names)
    index[_axis(x, dim)] = slice(begin, begin + size)
    return Named(x.array[tuple(index)], x.names)


def split(x: Named, dim: str, sizes: int | Sequence[int]) -> list[Named]:
    n = x.sizes[dim]
    sizes = [n // sizes] * sizes if isinstance(sizes, int) else list(sizes)
    starts = np.cumsum([0, *sizes[:-1]])
    return [slice_(x, int(b), s, dim) for b, s in zip(starts, sizes)]


def pad(x: Named, before: int, after: int, dim: str, value: float = 0.0) -> Named:
    xp = xp_of(x)
    widths = [(0, 0)] * len(x.names)
    widths[_axis(x, dim)] = (before, after)
    return Named(xp.pad(x.array, widths, constant_values=value), x.names)


def stack(xs: Sequence[Named], name: str, axis: int = 0) -> Named:
    xp = xp_of(*xs)
    names = list(xs[0].names)
    names.insert(axis, name)
    return Named(xp.stack([x.to(xs[0].names).array for x in xs], axis=axis), names)


def unstack(x: Named, dim: str) -> list[Named]:
    xp = xp_of(x)
    rest = [n for n in x.names if n != dim]
    moved = xp.moveaxis(x.array, _axis(x, dim), 0)
    return [Named(moved[i], rest) for i in range(x.sizes[dim])]


def arange(name: str, size: int, dtype: Any = np.int32) -> Named:
    return Named(np.arange(size, dtype=dtype), [name])


def one_hot(indices: Named, name: str, size: int, on: float = 1.0, off: float = 0.0, dtype: Any = np.float32) -> Named:
    xp = xp_of(indices)
    hit = indices.array[..., None] == xp.arange(size)
    return Named(xp.where(hit, on, off).astype(dtype), [*indices.names, name])


def gather(weights: Named, indices: Named, dim: str) -> Named:
    """``weights`` along ``dim`` at ``indices``: dims ``indices + (weights - dim)``; out of range -> 0."""
    xp = xp_of(weights, indices)
    n = weights.sizes[dim]
    w = xp.moveaxis(weights.array, _axis(weights, dim), 0)
    idx = indices.array
    inside = (idx >= 0) & (idx < n)
    taken = w[xp.clip(idx, 0, n - 1)]  # indices.shape + rest
    mask = xp.reshape(inside, inside.shape + (1,) * (w.ndim - 1))
    rest = [m for m in weights.names if m != dim]
    return Named(xp.where(mask, taken, xp.zeros_like(taken)), [*indices.names, *rest])


def take_along(x: Named, indices: Named, dim: str) -> Named:
    """``out[i] = x[i, indices[i]]`` along ``dim``: dims of ``x`` without ``dim``, the indices
    broadcast over the dims they lack; out of range -> 0."""
    xp = xp_of(x, indices)
    rest = [n for n in x.names if n != dim]
    n = x.sizes[dim]
    a = x.to([*rest, dim]).array
    idx = xp.broadcast_to(expand(indices, rest), a.shape[:-1])
    inside = (idx >= 0) & (idx < n)
    taken = xp.take_along_axis(a, xp.clip(idx, 0, n - 1)[..., None], axis=-1)[..., 0]
    return Named(xp.where(inside, taken, xp.zeros_like(taken)), rest)


def _stable_descending(xp, a):
    """Positions along the last axis, largest first in ``lax.top_k``'s order (a total order: a NaN
    with its sign bit clear first, one with it set last, ``+0.0`` before ``-0.0``), ties in index
    order (a stable sort of -a, keyed first by the NaN's class, the sign bit breaking the tie of two
    zeros)."""
    nan = xp.isnan(a)
    negative = xp.signbit(a)
    rank = xp.where(nan, xp.where(negative, 2, 0), 1)
    key = xp.where(nan, xp.zeros_like(a), -a)
    sign = negative.astype(np.int32)
    if xp is np:
        return np.lexsort((sign, key, rank), axis=-1)
    return jnp.lexsort((sign, key, rank), axis=-1)


def top_k(x: Named, dim: str, k_name: str, k: int) -> tuple[Named, Named]:
    """(values, indices) of the ``k`` largest along ``dim``, largest first, ties to the lower index."""
    xp = xp_of(x)
    rest = [n for n in x.names if n != dim]
    a = x.to([*rest, dim]).array
    order = _stable_descending(xp, _stop_gradient(xp, a))[..., :k]
    values = xp.take_along_axis(a, order, axis=-1)
    return Named(values, [*rest, k_name]), Named(order.astype(np.int32), [*rest, k_name])


def argmax(x: Named, dim: str) -> Named:
    """Index of the first maximum along ``dim`` (numpy's tie rule)."""
    xp = xp_of(x)
    return Named(xp.argmax(x.array, axis=_axis(x, dim)).astype(np.int32), [n for n in x.names if n != dim])


def cumsum(x: Named, dim: str, exclusive: bool = False) -> Named:
    xp = xp_of(x)
    axis = _axis(x, dim)
    total = xp.cumsum(x.array, axis=axis)
    if exclusive:  # the sum strictly before: shifted by one (``total - x`` is NaN at an inf)
        n = x.sizes[dim]
        before = xp.take(total, np.arange(-1, n - 1) % n, axis=axis)
        first = np.reshape(np.arange(n) == 0, [n if i == axis else 1 for i in range(len(x.names))])
        total = xp.where(first, xp.zeros_like(before), before)
    return Named(total, x.names)


def shift(x: Named, offset: int, dim: str, wrap: bool = False) -> Named:
    """``out[i] = x[i - offset]`` along ``dim``: cyclic with ``wrap``, else zeros where ``i - offset`` is outside."""
    xp = xp_of(x)
    n, axis = x.sizes[dim], _axis(x, dim)
    source = np.arange(n) - offset
    inside = (source >= 0) & (source < n)
    taken = xp.take(x.array, source % n, axis=axis)
    if wrap:
        return Named(taken, x.names)
    mask = np.reshape(inside, [n if i == axis else 1 for i in range(len(x.names))])
    return Named(xp.where(mask, taken, xp.zeros_like(taken)), x.names)


def conv2d(
    x: Named, kernel: Named, height: str, width: str, in_dim: str, out_dim: str, kernel_height: str, kernel_width: str
) -> Named:
    """Stride 1, SAME zero padding, odd kernel sizes: ``sum over (u, v, c) of x[.., i + u - kh // 2,
    j + v - kw // 2, c] * kernel[u, v, c, o]``; ``x``'s dims with ``in_dim`` replaced by ``out_dim``."""
    xp = xp_of(x, kernel)
    batch = [n for n in x.names if n not in (height, width, in_dim)]
    a = x.to([*batch, height, width, in_dim]).array
    k = kernel.to([kernel_height, kernel_width, in_dim, out_dim]).array
    kh, kw = k.shape[:2]
    h, w = x.sizes[height], x.sizes[width]
    padded = xp.pad(a, [(0, 0)] * len(batch) + [(kh // 2, kh // 2), (kw // 2, kw // 2), (0, 0)])
    out = sum(padded[..., u : u + h, v : v + w, :] @ k[u, v] for u in range(kh) for v in range(kw))
    return Named(out, [*batch, height, width, out_dim]).to([out_dim if n == in_dim else n for n in x.names])
