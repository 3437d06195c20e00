"""Reductions over named dims, and the softmax family built on them.

A reduction over a split dim reduces the local shard, then combines across the dim's mesh axes:
``psum`` for sums (kept pending, so adding partial results first costs one collective), ``pmax``
and ``pmin`` for extrema. ``logsumexp`` and ``softmax`` are written with these ops, so they work
over a split ``vocab`` with one ``pmax`` and one ``psum``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp

from meshdsl.dims import Dim, Shape, resolve
from meshdsl.errors import ShapeError
from meshdsl.layout import Split
from meshdsl.lowering.base import Lowering
from meshdsl.lowering.context import current, op, use
from meshdsl.ops import elementwise as ew
from meshdsl.ops.elementwise import check_float
from meshdsl.tensor import Tensor

# The dims an op works over; None (for the reductions) means all of them.
SomeDims = str | Dim | Iterable[str | Dim]
Dims = SomeDims | None


def _reduced(x: Tensor, dims: Dims) -> tuple[int, ...]:
    if dims is None:
        return tuple(range(x.shape.rank))
    names = [d.name for d in resolve(dims, x.shape)]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ShapeError(f"dims {names} name {', '.join(map(repr, twice))} twice")
    return tuple(x.shape.index(n) for n in names)


def require_entries(name: str, x: Tensor, positions: Iterable[int], what: str = "a maximum") -> None:
    """A ShapeError when a dim at ``positions`` of ``x`` has size 0: ``what`` (a maximum, a
    normalisation) over no entries has no value (jnp raises; ``argmax`` would give an index past the end)."""
    for i in positions:
        if x.shape[i].size == 0:
            raise ShapeError(f"{name}: {x.shape[i]} of {x.shape} has size 0; {what} over no entries is undefined")


def _reduce(x: Tensor, dims: Dims, combine: str) -> Tensor:
    lowering = current()
    positions = _reduced(x, dims)
    if combine != "sum":
        require_entries(f"reduce_{combine}", x, positions)
    out = x.shape.without(x.shape[i] for i in positions)
    axes = lowering.axes(x.shape)
    split = tuple(a for i in positions for a in axes[i])
    out_axes = tuple(a for i, a in enumerate(axes) if i not in positions)
    if combine == "sum":
        local = jnp.sum(x._data if x.pending else lowering.prepare(x), axis=positions)
        return lowering.finish(local, out, out_axes, pending=x.pending + split, lazy=True)
    array = lowering.prepare(x)
    local = (
        lowering.reduce_max(array, positions, split)
        if combine == "max"
        else -lowering.reduce_max(-array, positions, split)
    )
    return lowering.finish(local, out, out_axes)


@op("reduce_sum")
def reduce_sum(x: Tensor, dims: Dims = None) -> Tensor:
    """Sum over ``dims`` (a name, a Dim or a list; None: all dims)."""
    return _reduce(x, dims, "sum")


@op("reduce_mean")
def reduce_mean(x: Tensor, dims: Dims = None) -> Tensor:
    """Mean over ``dims``."""
    count = 1
    for i in _reduced(x, dims):
        count *= x.shape[i].size
    return reduce_sum(x, dims) / count


@op("reduce_max")
def reduce_max(x: Tensor, dims: Dims = None) -> Tensor:
    """Maximum over ``dims``."""
    return _reduce(x, dims, "max")


@op("reduce_min")
def reduce_min(x: Tensor, dims: Dims = None) -> Tensor:
    """Minimum over ``dims``."""
    return _reduce(x, dims, "min")


def _shift(x: Tensor, dims: Dims) -> Tensor:
    """The maximum of ``x`` over ``dims``, through which no gradient flows: what the softmax family
    subtracts before ``exp``. Taken of ``stop_gradient(x)``, so no derivative rule of the maximum runs:
    on the gspmd backend the rule's (value, index) reduction would otherwise reach XLA, which moves
    both by all-gathers where the maximum alone is one all-reduce."""
    return reduce_max(ew.stop_gradient(x), dims)


@op("logsumexp")
def logsumexp(x: Tensor, dims: Dims = None) -> Tensor:
    """log(sum(exp(x))) over ``dims``, computed stably.

    A maximum that is not finite shifts by 0, as ``jax.nn.logsumexp`` does: a row of ``-inf`` (fully
    masked) gives ``-inf``, not ``-inf - -inf = nan``.
    """
    require_entries("logsumexp", x, _reduced(x, dims), "a logsumexp")
    top = ew._map("finite", lambda a: jnp.where(jnp.isfinite(a), a, jnp.zeros_like(a)), _shift(x, dims))
    return ew.log(reduce_sum(ew.exp(x - top), dims)) + top


@op("softmax")
def softmax(x: Tensor, dims: SomeDims) -> Tensor:
    """exp(x) normalised to sum to 1 over ``dims``.

    Its derivative is given directly (``y * (t - sum(y * t))``, as ``jax.nn.softmax`` does), which
    saves the backward pass differentiating through the exponential and the division.
    """
    names = tuple(d.name for d in resolve(dims, x.shape))
    require_entries("softmax", x, [x.shape.index(n) for n in names], "a softmax")
    check_float("softmax", x)
    lowering = current()
    axes = lowering.axes(x.shape)
    return lowering.finish(_softmax(lowering.prepare(x), lowering, x.shape, axes, names), x.shape, axes)


def _on_local(
    lowering: Lowering, shape: Shape, axes: Split, fn: Callable[..., Tensor], *arrays: jax.Array
) -> jax.Array:
    """``fn`` of tensors of ``shape`` whose local arrays, laid out as ``axes``, are ``arrays``: its
    result's local array in its own layout, with no pending sums.

    JAX calls a custom derivative rule when it differentiates, which for ``jax.grad`` around a
    compiled function is after that function was traced and its lowering left.
    So the rule takes and returns arrays (a Tensor's pytree metadata, its layout and pending sums,
    may differ between a primal and its tangent) and runs its ops under the lowering it was made in.
    """
    with use(lowering):
        return lowering.prepare(fn(*(lowering.keep(a, shape, axes) for a in arrays)))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3, 4))
def _softmax(array: jax.Array, lowering: Lowering, shape: Shape, axes: Split, names: tuple[str, ...]) -> jax.Array:
    def value(x: Tensor) -> Tensor:
        e = ew.exp(x - _shift(x, names))
        return e / reduce_sum(e, names)

    return _on_local(lowering, shape, axes, value, array)


@_softmax.defjvp
def _softmax_jvp(
    lowering: Lowering, shape: Shape, axes: Split, names: tuple[str, ...], primals: tuple, tangents: tuple
) -> tuple:
    (x,), (t,) = primals, tangents
    y = _softmax(x, lowering, shape, axes, names)
    tangent = _on_local(lowering.linear_sums(), shape, axes, lambda y, t: y * (t - reduce_sum(y * t, names)), y, t)
    return y, tangent


@op("log_softmax")
def log_softmax(x: Tensor, dims: SomeDims) -> Tensor:
    """log(softmax(x)) over ``dims``, computed stably. Like ``softmax``, it needs its dims named:
    ``None`` (all dims, for the reductions) is refused rather than normalising over the batch.

    Computed as ``jax.nn.log_softmax`` is, ``(x - m) - log(sum(exp(x - m)))`` with ``m`` the maximum:
    a row holding NaN or +inf gives NaN throughout, as there, not ``-inf`` beside a NaN."""
    names = resolve(dims, x.shape)
    require_entries("log_softmax", x, [x.shape.index(d.name) for d in names], "a log_softmax")
    shifted = x - _shift(x, names)
    return shifted - ew.log(reduce_sum(ew.exp(shifted), names))
