"""Index ops: ``range``, ``one_hot``, ``gather``, ``top_k``, ``argmax``, ``cumsum``, ``shift``.

Each is written on the local block of its dim, with the block's global offset from the lowering,
so a split dim costs little or nothing:

* ``range`` and ``one_hot`` into a split dim build only the local block: no communication.
* ``gather`` from a split dim (a vocab-parallel embedding) looks up the indices that fall in the
  local block, zeros the rest, and leaves a pending ``psum``.
* ``top_k`` over a split dim takes the local top k, ``all_gather``\\ s the candidates (values and
  indices) and takes the top k of those.
* ``argmax`` over a split dim takes the local maximum, then ``pmax`` of the values (of their order
  keys, which keep NaN) and ``pmin`` of the indices that reach it (ties go to the lowest index and
  the first NaN counts as largest, as in numpy).
* ``cumsum`` along a split dim adds the local cumulative sum to the total of the blocks before,
  from one ``all_gather`` of the block totals.
* ``shift`` along a split dim moves the overflow of each block to its neighbour with
  ``ppermute`` (a halo exchange).
"""

from __future__ import annotations

import builtins
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshdsl.dims import Dim, DimLike, Shape
from meshdsl.errors import ShapeError
from meshdsl.lowering import compute_split
from meshdsl.lowering.base import NO_INDEX, max_and_index, reaches
from meshdsl.lowering.context import current, op
from meshdsl.ops import elementwise
from meshdsl.ops.reduction import require_entries
from meshdsl.tensor import Tensor, describe, dtype_of


def _local_iota(lowering, dim: Dim, axes: tuple[str, ...], dtype: Any) -> jax.Array:
    local, offset = lowering.shard(dim.size, axes)
    return (jnp.arange(local) + offset).astype(dtype)


@op("one_hot")
def one_hot(
    indices: Tensor, output_dim: Dim, on_value: float = 1.0, off_value: float = 0.0, dtype: Any = jnp.float32
) -> Tensor:
    """``on_value`` where ``indices`` equals the position along the new dim ``output_dim``, else ``off_value``."""
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        raise ShapeError(f"one_hot: indices must be integers, got {describe(indices)}", op="one_hot")
    if not isinstance(output_dim, Dim):
        raise ShapeError(
            f"one_hot: output_dim must be an md.Dim (name and size), got {describe(output_dim)}", op="one_hot"
        )
    dtype = dtype_of(dtype, "one_hot")
    if output_dim.name in indices.shape:
        raise ShapeError(
            f"one_hot: output_dim {output_dim} is already a dim of the indices {indices.shape}; name the new dim "
            "differently",
            op="one_hot",
        )
    lowering = current()
    out = indices.shape + [output_dim]
    axes = lowering.axes(out)
    iota = _local_iota(lowering, output_dim, axes[-1], indices.dtype)
    hit = lowering.prepare(indices)[..., None] == iota
    return lowering.finish(jnp.where(hit, on_value, off_value).astype(dtype), out, axes)


@op("gather")
def gather(weights: Tensor, indices: Tensor, dim: DimLike) -> Tensor:
    """Entries of ``weights`` along ``dim`` at ``indices``: shape ``indices.shape + weights.shape - dim``.

    An index outside ``dim`` gives zeros, under every layout.
    """
    lowering = current()
    d = weights.shape[dim]
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        raise ShapeError(f"gather: indices must be integers, got {indices.dtype}", op="gather")
    rest = weights.shape.without([d.name])
    if d.name in indices.shape:
        raise ShapeError(
            f"gather: the indices {indices.shape} have a dim named {d.name}, like the dim {d} gathered from the "
            "weights "
            f"{weights.shape}; the result's {d.name} would be another dim of the same name: rename one (md.rename)",
            op="gather",
        )
    shared = [n for n in indices.shape.names if n in rest]
    if shared:
        raise ShapeError(
            f"gather: the indices {indices.shape} and the weights {weights.shape} both have dim(s) "
            f"{', '.join(shared)}; "
            f"the result (the indices' dims, then the weights' without {d.name}) would hold them twice",
            op="gather",
        )
    out = indices.shape + rest

    def result(split: compute_split.NameAxes):
        return tuple(split[n] for n in out.names), split[d.name]

    split = compute_split.choose(lowering, [weights, indices], out, result, weights.dtype.itemsize)
    w = lowering.prepare(weights, tuple(split[n] for n in weights.shape.names), beside=[indices])
    idx = lowering.prepare(indices, tuple(split[n] for n in indices.shape.names), beside=[weights])
    size, offset = lowering.shard(d.size, split[d.name])
    position = weights.shape.index(d.name)
    local = idx - offset
    local = jnp.where(local < 0, size, local)  # 'fill' mode would wrap a negative index
    taken = jnp.take(w, local, axis=position, mode="fill", fill_value=0)
    k = indices.shape.rank
    perm = [
        *builtins.range(position, position + k),
        *builtins.range(position),
        *builtins.range(position + k, taken.ndim),
    ]
    out_axes, pending = result(split)
    return lowering.finish(jnp.transpose(taken, perm), out, out_axes, pending, lazy=True)


@op("take_along")
def take_along(x: Tensor, indices: Tensor, dim: DimLike) -> Tensor:
    """``x`` at position ``indices`` along ``dim``, entry by entry: ``out[i] = x[i, indices[i]]``.

    ``indices`` has dims of ``x`` other than ``dim``; the result has ``x``'s dims without ``dim``
    (broadcast over those ``indices`` lacks). An index outside ``dim`` gives zero. Over a split
    ``dim`` each device looks up the indices in its block and leaves a pending ``psum``.
    """
    lowering = current()
    d = x.shape[dim]
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        raise ShapeError(f"take_along: indices {indices.shape} must be integers, got {indices.dtype}", op="take_along")
    if d.name in indices.shape:
        raise ShapeError(
            f"take_along: the indices {indices.shape} have the looked-up dim {d.name}; they index along it, over dims "
            f"of x {x.shape} other than {d.name}",
            op="take_along",
        )
    extra = [n for n in indices.shape.names if n not in x.shape]
    if extra:
        raise ShapeError(
            f"take_along: the indices {indices.shape} have dim(s) {', '.join(extra)} that x {x.shape} lacks; they "
            f"index over dims of x other than {d.name}",
            op="take_along",
        )
    out = x.shape.without([d.name])
    axes = lowering.axes(x.shape)
    position = x.shape.index(d.name)
    size, offset = lowering.shard(d.size, axes[position])
    local = elementwise.align(lowering.prepare(indices, beside=[x]), indices.shape, out) - offset
    local = jnp.where(local < 0, size, local)  # 'fill' mode would wrap a negative index
    taken = jnp.take_along_axis(
        lowering.prepare(x, beside=[indices]),
        jnp.expand_dims(local, position),
        axis=position,
        mode="fill",
        fill_value=0,
    )
    return lowering.finish(
        jnp.squeeze(taken, position), out, axes[:position] + axes[position + 1 :], axes[position], lazy=True
    )


@op("top_k")
def top_k(x: Tensor, reduced_dim: DimLike, k_dim: Dim) -> tuple[Tensor, Tensor]:
    """The ``k_dim.size`` largest entries of ``x`` along ``reduced_dim`` and their indices (int32), as Mesh-TF.

    Both have shape ``x.shape - reduced_dim + k_dim``, largest first; ties go to the lower index.
    """
    if not isinstance(k_dim, Dim):
        raise ShapeError(f"top_k: k_dim must be an md.Dim (name and size k), got {describe(k_dim)}", op="top_k")
    lowering = current()
    position = x.shape.index(reduced_dim)
    require_entries("top_k", x, [position], "a top_k")
    d, k = x.shape[position], k_dim.size
    if k > d.size:
        raise ShapeError(f"top_k: k_dim {k_dim} is larger than {d}", op="top_k")
    if k_dim.name != d.name and k_dim.name in x.shape:
        raise ShapeError(
            f"top_k: k_dim {k_dim} is named like the dim {x.shape[k_dim.name]} of x {x.shape}, which the result keeps",
            op="top_k",
        )
    out = x.shape.without([d.name]) + [k_dim]
    axes = list(lowering.axes(x.shape))
    split = axes[position]
    if split and d.size // lowering.group_size(split) < k:
        split = axes[position] = ()
    array = jnp.moveaxis(lowering.prepare(x, tuple(axes)), position, -1)
    values, indices = lax.top_k(array, k)
    if split:
        _, offset = lowering.shard(d.size, split)
        indices = indices + offset
        last = values.ndim - 1
        values, best = lax.top_k(lowering.all_gather(values, split, last), k)
        indices = jnp.take_along_axis(lowering.all_gather(indices, split, last), best, axis=-1)
    out_axes = tuple(a for i, a in enumerate(axes) if i != position) + ((),)
    return lowering.finish(values, out, out_axes), lowering.finish(indices.astype(jnp.int32), out, out_axes)


@op("argmax")
def argmax(x: Tensor, reduced_dim: DimLike) -> Tensor:
    """Index (int32) of the largest entry along ``reduced_dim``; ties go to the lowest index."""
    lowering = current()
    position = x.shape.index(reduced_dim)
    require_entries("argmax", x, [position], "an argmax")
    axes = lowering.axes(x.shape)
    split = axes[position]
    best, index = max_and_index(lax.stop_gradient(lowering.prepare(x)), (position,))
    _, offset = lowering.shard(x.shape[position].size, split)
    index = index + offset
    if split:
        top = lowering.pmax(best, split)
        index = lowering.pmin(jnp.where(reaches(best, top), index, NO_INDEX), split)
    out = x.shape.without([x.shape[position].name])
    return lowering.finish(index, out, axes[:position] + axes[position + 1 :])


@op("cumsum")
def cumsum(x: Tensor, dim: DimLike, exclusive: bool = False) -> Tensor:
    """Cumulative sum along ``dim`` (``exclusive``: of the entries strictly before)."""
    lowering = current()
    position = x.shape.index(dim)
    split = lowering.axes(x.shape)[position]
    array = lowering.prepare(x)
    total = jnp.cumsum(array, axis=position)
    if exclusive:  # shifted by one, not ``total - array``: an inf entry would make its own place NaN
        first = jnp.zeros_like(lax.slice_in_dim(total, 0, 1, axis=position))
        total = jnp.concatenate([first, lax.slice_in_dim(total, 0, total.shape[position] - 1, axis=position)], position)
    if split:
        blocks = lowering.all_gather(jnp.sum(array, axis=position, keepdims=True), split, position)
        n = lowering.group_size(split)
        before = (jnp.arange(n) < lowering.axis_index(split)).reshape(
            (1,) * position + (n,) + (1,) * (array.ndim - position - 1)
        )
        total = total + jnp.sum(jnp.where(before, blocks, 0), axis=position, keepdims=True)
    return lowering.finish(total, x.shape)


@op("shift")
def shift(x: Tensor, offset: int, dim: DimLike, wrap: bool = False) -> Tensor:
    """``x`` moved by ``offset`` along ``dim`` (``out[i] = x[i - offset]``); zeros come in unless ``wrap``."""
    if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)):
        raise ShapeError(f"shift: offset must be an int, got {describe(offset)}", op="shift")
    lowering = current()
    position = x.shape.index(dim)
    size = x.shape[position].size
    split = lowering.axes(x.shape)[position]
    array = lowering.prepare(x)
    if wrap:
        offset %= size
    elif builtins.abs(offset) >= size:
        return lowering.finish(jnp.zeros_like(array), x.shape)
    block = size // lowering.group_size(split)
    hops, overflow = divmod(offset, block)
    stay = lax.slice_in_dim(array, 0, block - overflow, axis=position)
    moved = lowering.ppermute(stay, split, hops, wrap)
    if overflow:
        spill = lax.slice_in_dim(array, block - overflow, block, axis=position)
        moved = jnp.concatenate([lowering.ppermute(spill, split, hops + 1, wrap), moved], axis=position)
    return lowering.finish(moved, x.shape)


@op("range")
def range(dim: Dim, dtype: Any = jnp.int32) -> Tensor:  # noqa: A001  (md.range, as Mesh-TF's mtf.range)
    """The tensor ``[0, 1, ..., dim.size - 1]`` along ``dim``."""
    if not isinstance(dim, Dim):
        raise ShapeError(f"range: dim must be an md.Dim (name and size), got {describe(dim)}", op="range")
    dtype = dtype_of(dtype, "range")
    if not (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)):
        raise ShapeError(f"range: dtype {dtype.name} is neither an integer nor a float dtype", op="range")
    exact = jnp.iinfo(dtype).max if jnp.issubdtype(dtype, jnp.integer) else 2 ** (jnp.finfo(dtype).nmant + 1)
    if dim.size - 1 > exact:
        raise ShapeError(
            f"range: {dim} counts to {dim.size - 1}, but {dtype.name} holds integers exactly only up to {exact}; "
            "use a wider dtype",
            op="range",
        )
    lowering = current()
    shape = Shape([dim])
    axes = lowering.axes(shape)
    return lowering.finish(_local_iota(lowering, dim, axes[0], dtype), shape, axes)
