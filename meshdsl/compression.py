"""Compressed gradient sums: ``grad_reduce_dtype`` float16, bfloat16, float8_e4m3fn, float8_e5m2.

bfloat16 has float32's range, so a gradient is cast, summed and cast back (a linear map). float16
and the 8-bit formats overflow at 65504, 448 (e4m3fn) and 57344 (e5m2), so their sums are scaled:
one per-tensor scale ``s = pmax(max |g|) / t`` over the summing devices (a 4-byte all-reduce),
with ``t`` the largest value of the format at most ``max / n``; each device sends ``g / s`` in the
format, and no sum of ``n`` of them can exceed the format's maximum. The values are sent as
unsigned integers of the same width (XLA's CPU backend would otherwise widen an 8-bit float
collective to 16 bits): an all-to-all of ``n`` blocks, a local float32 sum of each block's ``n``
parts rounded once to the format, and an all-gather of the sums (a reduce-scatter stops after
the local sum). The bytes are a ring all-reduce's (reduce-scatter's) in the 8- or 16-bit format.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from meshdsl.collectives import GRAD_REDUCE_DTYPES, Collective, bytes_moved

DTYPES = GRAD_REDUCE_DTYPES
"""The dtypes a gradient sum can be compressed to (``--grad-reduce-dtype``)."""

_WIRE = {1: jnp.uint8, 2: jnp.uint16}


def scaled(dtype: Any) -> bool:
    """Whether sums in ``dtype`` are scaled (float16 and the 8-bit floats; not bfloat16, nor None)."""
    return dtype is not None and jnp.dtype(dtype).name in ("float16", "float8_e4m3fn", "float8_e5m2")


def target(dtype: Any, n: int) -> float:
    """The largest value of ``dtype`` at most its maximum over ``n``: each device's largest scaled entry."""
    dt = np.dtype(jnp.dtype(dtype))
    limit = float(ml_dtypes.finfo(dt).max) / n
    value = np.array(limit, np.float64).astype(dt)
    if float(value) > limit:
        value = np.nextafter(value, np.array(0, dt))
    return float(value)


def scale(amax: jax.Array, dtype: Any, n: int) -> jax.Array:
    """The per-tensor scale for a largest magnitude ``amax`` over ``n`` devices (1 where ``amax`` is 0)."""
    return jnp.where(amax > 0, amax / jnp.float32(target(dtype, n)), jnp.float32(1))


def _send(q: jax.Array, fn: Any) -> jax.Array:
    """``fn`` (a data-moving collective) run on ``q``'s bits as unsigned integers of the same width."""
    wire = _WIRE[q.dtype.itemsize]
    return lax.bitcast_convert_type(fn(lax.bitcast_convert_type(q, wire)), q.dtype)


def _quantize(g: jax.Array, axes: tuple[str, ...], dtype: Any, n: int) -> tuple[jax.Array, jax.Array]:
    """``g`` (float32) over its scale in ``dtype``, and the scale (a pmax over ``axes``)."""
    s = scale(lax.pmax(jnp.max(jnp.abs(g)), axes), dtype, n)
    return (g / s).astype(dtype), s


def _block_sums(q: jax.Array, axes: tuple[str, ...], n: int) -> jax.Array:
    """Of ``q`` (leading dim a multiple of ``n``), this device's block summed over ``axes`` in float32."""
    parts = _send(q, lambda w: lax.all_to_all(w, axes, 0, 0, tiled=True))
    return parts.astype(jnp.float32).reshape(n, -1, *q.shape[1:]).sum(axis=0)


def psum(g: jax.Array, axes: tuple[str, ...], n: int, dtype: Any) -> jax.Array:
    """``lax.psum(g, axes)`` (``n`` devices) sent in ``dtype`` with a shared scale; replicated result."""
    return psum_with_error(g, axes, n, dtype)[0]


def psum_with_error(g: jax.Array, axes: tuple[str, ...], n: int, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """:func:`psum` (bfloat16: a cast and a ``psum``), and this device's rounding error: ``g`` less what it
    sent, scaled back, plus (scaled sums) the rounding of the block of the sum this device added up;
    the devices' errors add up to the exact sum less the result (what error feedback adds to the
    next step's gradient). bfloat16's ``psum`` rounds inside XLA's reduction: its error is the cast's."""
    if not scaled(dtype):
        sent = g.astype(dtype)
        return lax.psum(sent, axes).astype(g.dtype), g - sent.astype(g.dtype)
    q, s = _quantize(g.astype(jnp.float32), axes, dtype, n)
    flat = q.reshape(-1)
    pad = -flat.size % n
    exact = _block_sums(jnp.pad(flat, (0, pad)), axes, n)
    sums = exact.astype(dtype)
    whole = _send(sums, lambda w: lax.all_gather(w, axes, axis=0, tiled=True, to="invarying"))
    total = (whole[: g.size].astype(jnp.float32) * s).reshape(g.shape).astype(g.dtype)
    # The sum's own rounding, of the block this device summed, is this device's to carry too:
    # added to its error there, the next sum (which adds every device's error) restores it.
    rounded = lax.dynamic_update_slice(
        jnp.zeros(flat.size + pad, jnp.float32), exact - sums.astype(jnp.float32), (lax.axis_index(axes) * exact.size,)
    )
    error = g.astype(jnp.float32) - q.astype(jnp.float32) * s + rounded[: g.size].reshape(g.shape) * s
    return total, error.astype(g.dtype)


def psum_scatter(g: jax.Array, axes: tuple[str, ...], n: int, dtype: Any) -> jax.Array:
    """``lax.psum_scatter(g, axes, scatter_dimension=0, tiled=True)`` sent in ``dtype`` with a shared scale."""
    q, s = _quantize(g.astype(jnp.float32), axes, dtype, n)
    return (_block_sums(q, axes, n).astype(dtype).astype(jnp.float32) * s).astype(g.dtype)


def sum_bytes(elements: int, n: int, dtype: Any, collective: Collective = Collective.ALL_REDUCE) -> float:
    """Bytes per device of :func:`psum` (``ALL_REDUCE``) or :func:`psum_scatter` (``REDUCE_SCATTER``) of
    ``elements`` values over ``n`` devices: the pmax of the scale, and the format's all-to-all and all-gather."""
    if n <= 1:
        return 0.0
    size = jnp.dtype(dtype).itemsize
    padded = math.ceil(elements / n) * n * size
    moved = bytes_moved(Collective.ALL_TO_ALL, padded, padded, n)
    if collective is Collective.ALL_REDUCE:
        moved += bytes_moved(Collective.ALL_GATHER, padded // n, padded, n)
    return float(bytes_moved(Collective.ALL_REDUCE, 4, 4, n) + moved)
