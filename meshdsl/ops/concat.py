"""Ops that cut and join along one dim: ``concat``, ``split``, ``slice``, ``pad``, ``stack``, ``unstack``.

Each works on the named dim locally, so that dim is gathered first if it is split
(``all_gather``), and the result is sliced back to its own layout (local, free). Other dims keep
their splits and cost nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax

from meshdsl.dims import Dim, DimLike, Shape
from meshdsl.errors import ShapeError
from meshdsl.layout import Split
from meshdsl.lowering.context import current, op
from meshdsl.tensor import Tensor, describe


def _unsplit(axes: Split, position: int) -> Split:
    return tuple(() if i == position else a for i, a in enumerate(axes))


def _along(x: Tensor, dim: DimLike):
    """(lowering, position of ``dim``, local array with ``dim`` whole, that layout)."""
    lowering = current()
    position = x.shape.index(dim)
    axes = _unsplit(lowering.axes(x.shape), position)
    return lowering, position, lowering.prepare(x, axes), axes


def _tensors(xs: Sequence[Tensor]) -> list[Tensor]:
    """``xs`` as a list of one or more md tensors (a ShapeError names what else it holds)."""
    if isinstance(xs, Tensor) or not isinstance(xs, (list, tuple)) or not xs:
        raise ShapeError(f"xs must be a non-empty list of md tensors, got {describe(xs)}")
    for i, t in enumerate(xs):
        if not isinstance(t, Tensor):
            raise ShapeError(f"xs[{i}] must be an md tensor, got {describe(t)}")
    return list(xs)


def _resized(shape: Shape, position: int, size: int) -> Shape:
    return Shape(Dim(d.name, size) if i == position else d for i, d in enumerate(shape))


@op("concat")
def concat(xs: Sequence[Tensor], dim: DimLike) -> Tensor:
    """Join ``xs`` along ``dim``; their other dims must agree."""
    xs = _tensors(xs)
    first = xs[0]
    position = first.shape.index(dim)
    name = first.shape[position].name
    for t in xs[1:]:
        if t.shape.without([name]) != first.shape.without([name]) or name not in t.shape:
            raise ShapeError(f"concat along {name}: {t.shape} does not match {first.shape} outside {name}", op="concat")
    lowering = current()
    arrays = []
    for t in xs:
        _, p, array, _ = _along(t, name)
        arrays.append(jnp.moveaxis(array, p, position))
    out = _resized(first.shape, position, sum(t.shape[name].size for t in xs))
    return lowering.finish(jnp.concatenate(arrays, axis=position), out, _unsplit(lowering.axes(first.shape), position))


@op("split")
def split(x: Tensor, dim: DimLike, num_or_size_splits: int | Sequence[int]) -> list[Tensor]:
    """Cut ``x`` along ``dim`` into equal parts (an int) or parts of the given sizes."""
    lowering, position, array, axes = _along(x, dim)
    size = x.shape[position].size
    if isinstance(num_or_size_splits, int):
        if num_or_size_splits <= 0 or size % num_or_size_splits:
            raise ShapeError(
                f"split: {x.shape[position]} cannot be cut into {num_or_size_splits} equal parts", op="split"
            )
        sizes = [size // num_or_size_splits] * num_or_size_splits
    else:
        sizes = list(num_or_size_splits)
        if sum(sizes) != size or min(sizes) < 0:
            raise ShapeError(f"split: sizes {sizes} do not add up to {x.shape[position]}", op="split")
    out, start = [], 0
    for s in sizes:
        part = lax.slice_in_dim(array, start, start + s, axis=position)
        out.append(lowering.finish(part, _resized(x.shape, position, s), axes))
        start += s
    return out


@op("slice")
def slice(x: Tensor, begin: int, size: int, dim: DimLike) -> Tensor:  # noqa: A001  (as Mesh-TF)
    """The ``size`` entries of ``x`` along ``dim`` starting at ``begin``."""
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in (begin, size)):
        raise ShapeError(f"slice: begin and size must be ints, got {begin!r} and {size!r}", op="slice")
    lowering, position, array, axes = _along(x, dim)
    d = x.shape[position]
    if begin < 0 or size < 0 or begin + size > d.size:
        raise ShapeError(f"slice [{begin}, {begin + size}) is outside {d}", op="slice")
    part = lax.slice_in_dim(array, begin, begin + size, axis=position)
    return lowering.finish(part, _resized(x.shape, position, size), axes)


@op("pad")
def pad(x: Tensor, paddings: Sequence[int], dim: DimLike, value: float = 0) -> Tensor:
    """``x`` with ``paddings = [before, after]`` entries of ``value`` added along ``dim``."""
    if (
        not isinstance(paddings, (list, tuple))
        or len(paddings) != 2
        or not all(isinstance(p, int) and p >= 0 for p in paddings)
    ):
        raise ShapeError(f"pad: paddings must be [before, after], two non-negative ints, got {paddings!r}", op="pad")
    before, after = paddings
    lowering, position, array, axes = _along(x, dim)
    widths = [(0, 0)] * array.ndim
    widths[position] = (before, after)
    out = _resized(x.shape, position, x.shape[position].size + before + after)
    return lowering.finish(jnp.pad(array, widths, constant_values=value), out, axes)


@op("stack")
def stack(xs: Sequence[Tensor], dim: str, axis: int = 0) -> Tensor:
    """Stack equally shaped ``xs`` along a new dim called ``dim``, placed at position ``axis``."""
    xs = _tensors(xs)
    for t in xs[1:]:
        if t.shape != xs[0].shape:
            raise ShapeError(f"stack: {t.shape} differs from {xs[0].shape}", op="stack")
    lowering = current()
    dims = list(xs[0].shape)
    dims.insert(axis, Dim(dim, len(xs)))
    axes = list(lowering.axes(xs[0].shape))
    axes.insert(axis, ())
    array = jnp.stack([lowering.prepare(t) for t in xs], axis=axis)
    return lowering.finish(array, Shape(dims), tuple(axes))


@op("unstack")
def unstack(x: Tensor, dim: DimLike) -> list[Tensor]:
    """The slices of ``x`` along ``dim``, which they no longer have."""
    lowering, position, array, axes = _along(x, dim)
    out_shape = x.shape.without([x.shape[position].name])
    out_axes = axes[:position] + axes[position + 1 :]
    return [
        lowering.finish(lax.index_in_dim(array, i, position, keepdims=False), out_shape, out_axes)
        for i in range(x.shape[position].size)
    ]
