"""``update_slice``: write a block into a tensor at a position along one dim known only at run time.

A KV cache takes each step's keys and values this way. Where the dim is whole on every device
(the cache's ``memory`` under data or tensor parallelism), each device writes its own block of
the update into its own block of ``x`` with ``lax.dynamic_update_slice``: no communication, and
with ``x`` donated XLA writes into ``x``'s buffer. Where the dim is split, each device keeps the
entries of ``x`` outside the written range and takes the update's entries inside it (a
``where`` over its block; the update is gathered along ``dim`` first, it is the small operand).
Other dims keep ``x``'s layout; the update is brought to it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshdsl.dims import DimLike
from meshdsl.errors import ShapeError
from meshdsl.lowering.context import current, op
from meshdsl.tensor import Tensor, describe


def _index(index: Tensor | int | jax.Array) -> tuple[Tensor | None, int | None]:
    """``index`` as a 0-d integer tensor or a Python int (ShapeError for anything else)."""
    if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
        return None, int(index)
    if isinstance(index, Tensor) and index.shape.rank == 0 and jnp.issubdtype(index.dtype, jnp.integer):
        return index, None
    raise ShapeError(f"update_slice: index must be an int or a 0-d integer md tensor, got {describe(index)}")


@op("update_slice")
def update_slice(
    x: Tensor, update: Tensor, index: Tensor | int, dim: DimLike, update_dim: DimLike | None = None
) -> Tensor:
    """``x`` with ``update`` written at ``index`` along ``dim`` (``out[index + i] = update[i]``).

    ``update`` has ``x``'s dims, in any order, except that along ``dim`` it has ``update_dim``
    (default: ``dim`` itself) of any size up to ``dim``'s: a cache's ``memory`` takes a step's
    ``length``, which the layout may split otherwise. ``index`` is an int or a 0-d integer tensor
    (a traced position); as in ``lax.dynamic_update_slice``, an index past the end is clamped so
    the whole update fits.
    """
    position = x.shape.index(dim)
    name = x.shape[position].name
    along = name if update_dim is None else update.shape[update_dim].name
    rest = update.shape.without([along])
    if along not in update.shape or name in rest or rest != x.shape.without([name]):
        raise ShapeError(f"update_slice along {name}: update {update.shape} does not match x {x.shape} outside {along}")
    n, size = update.shape[along].size, x.shape[position].size
    if n > size:
        raise ShapeError(
            f"update_slice along {name}: update's {update.shape[along]} is longer than x's {x.shape[name]}"
        )
    if update.dtype != x.dtype:
        raise ShapeError(f"update_slice: update is {update.dtype}, x is {x.dtype}; cast one to the other")
    tensor_index, static = _index(index)
    lowering = current()
    axes = lowering.axes(x.shape)
    array = lowering.prepare(x)
    start = jnp.asarray(static, jnp.int32) if tensor_index is None else lowering.prepare(tensor_index)
    start = jnp.clip(start.astype(jnp.int32), 0, size - n)
    order = [update.shape.index(along if d.name == name else d.name) for d in x.shape]
    split = axes[position]
    update_axes = tuple(axes[x.shape.index(d.name)] if d.name != along else () for d in update.shape)
    new = jnp.transpose(lowering.prepare(update, update_axes), order)
    new, array = lowering.vary_like(new, array, start), lowering.vary_like(array, new, start)
    start = lowering.vary_like(start, array)
    if not split:
        starts = [jnp.zeros((), jnp.int32)] * array.ndim
        starts[position] = start
        return lowering.finish(lax.dynamic_update_slice(array, new, starts), x.shape, axes)
    local, offset = lowering.shard(size, split)
    relative = jnp.arange(local) + offset - start
    inside = (relative >= 0) & (relative < n)
    taken = jnp.take(new, jnp.clip(relative, 0, n - 1), axis=position)
    shape = [1] * array.ndim
    shape[position] = local
    return lowering.finish(jnp.where(inside.reshape(shape), taken, array), x.shape, axes)
