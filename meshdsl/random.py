"""Random tensors that are the same under every layout, each device drawing only its own shard.

Entry ``i`` (row-major global position) of a random tensor is the Threefry-2x32 hash of the key
and ``i``. Each device hashes the global positions of its own block, so the values do not depend
on the mesh or layout, and no device draws what it does not keep. This is the same counter
scheme as JAX's partitionable Threefry (``jax_threefry_partitionable``, the default), so
``md.random.normal(key, shape)`` equals ``jax.random.normal(key, shape.sizes)``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.random import threefry2x32_p

from meshdsl.arguments import number
from meshdsl.dims import ShapeLike, as_shape
from meshdsl.errors import ConfigError, ShapeError
from meshdsl.lowering.context import current, op
from meshdsl.ops.elementwise import where
from meshdsl.ops.reshape import transpose
from meshdsl.tensor import Tensor, describe, dtype_of

__all__ = ["bits", "dropout", "normal", "uniform"]


def _key_words(key: Any) -> tuple[jax.Array, jax.Array]:
    if hasattr(key, "dtype") and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    if not hasattr(key, "dtype") or key.shape != (2,) or key.dtype != jnp.uint32:
        raise ShapeError(f"md.random needs a threefry key (jax.random.key(seed) or PRNGKey), got {describe(key)}")
    return key[0], key[1]


@op("random_bits")
def bits(key: Any, shape: ShapeLike) -> Tensor:
    """Uniformly random uint32 values of ``shape``."""
    shape = as_shape(shape)
    if shape.size >= 2**32:
        raise ShapeError(f"md.random: {shape} has {shape.size} elements; at most 2**32 - 1 are supported", op="random")
    lowering = current()
    axes = lowering.axes(shape)
    position = jnp.zeros((), jnp.uint32)
    stride = 1
    for i in reversed(range(shape.rank)):
        local, offset = lowering.shard(shape[i].size, axes[i])
        index = lax.broadcasted_iota(jnp.uint32, [s.size // lowering.group_size(a) for s, a in zip(shape, axes)], i)
        position = position + (index + jnp.asarray(offset, jnp.uint32)) * np.uint32(stride)
        stride *= shape[i].size
    k1, k2 = _key_words(key)
    # The primitive neither unifies its operands' manual-axis types nor passes them on: give every
    # operand and the result those of the positions. The key words stay scalars (the primitive
    # broadcasts them), so its loop carries two arrays, not four.
    k1, k2 = (lowering.vary_like(a, position) for a in (k1, k2))
    hi = lowering.vary_like(jnp.zeros_like(position), position)
    b1, b2 = threefry2x32_p.bind(k1, k2, hi, position)
    return lowering.finish(lowering.vary_like(b1 ^ b2, position), shape, axes)


def _float_dtype(dtype: Any, name: str) -> np.dtype:
    """``dtype`` if it is a float dtype; ShapeError otherwise (an int dtype truncates the draws to a few values)."""
    dtype = dtype_of(dtype, f"md.random.{name}")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ShapeError(
            f"md.random.{name}: dtype {dtype.name} is not a floating dtype (float32, bfloat16, ...)",
            op=f"random.{name}",
        )
    return dtype


def check_rate(rate: Any) -> float:
    """``rate`` if it is a dropout rate, a number in [0, 1); ConfigError otherwise (NaN included)."""
    return number(rate, "dropout rate", at_least=0.0, below=1.0, op="dropout")


def _unit_floats(raw: jax.Array, dtype: Any) -> jax.Array:
    """Floats in [0, 1) from 32 random bits: the top 23 bits as the mantissa of a float in [1, 2), minus 1."""
    floats = lax.bitcast_convert_type((raw >> np.uint32(9)) | np.uint32(0x3F800000), jnp.float32) - 1.0
    return floats.astype(dtype)


@op("random_uniform")
def uniform(key: Any, shape: ShapeLike, dtype: Any = jnp.float32, minval: float = 0.0, maxval: float = 1.0) -> Tensor:
    """Uniform values in ``[minval, maxval)`` (``minval`` itself when they are equal); a float ``dtype``."""
    dtype = _float_dtype(dtype, "uniform")
    minval = number(minval, "md.random.uniform: minval", op="random.uniform")
    maxval = number(maxval, "md.random.uniform: maxval", op="random.uniform")
    if minval > maxval:
        raise ConfigError(f"md.random.uniform: minval {minval} is above maxval {maxval}", op="random.uniform")
    raw = bits(key, shape)
    lowering = current()
    unit = _unit_floats(raw._data, jnp.float32)
    values = jnp.maximum(np.float32(minval), unit * np.float32(maxval - minval) + np.float32(minval)).astype(dtype)
    return lowering.finish(values, raw.shape)


@op("random_normal")
def normal(key: Any, shape: ShapeLike, dtype: Any = jnp.float32) -> Tensor:
    """Standard normal values of a float ``dtype``."""
    dtype = _float_dtype(dtype, "normal")
    low = np.nextafter(np.float32(-1.0), np.float32(0.0))
    u = uniform(key, shape, jnp.float32, float(low), 1.0)
    lowering = current()
    return lowering.finish((np.float32(np.sqrt(2)) * lax.erf_inv(u._data)).astype(dtype), u.shape)


@op("dropout")
def dropout(key: Any, x: Tensor, rate: float, noise_shape: ShapeLike | None = None) -> Tensor:
    """``x`` with each entry zeroed with probability ``rate`` and the rest scaled by ``1 / (1 - rate)``.

    ``noise_shape`` (a subset of ``x``'s dims) shares one draw across the dims it leaves out.
    """
    check_rate(rate)
    noise = x.shape if noise_shape is None else as_shape(noise_shape)
    for d in noise:
        x.shape.index(d)  # a ShapeError unless every dim of noise_shape is one of x's
    if rate == 0.0:
        return x
    keep = uniform(key, noise) >= rate
    # A select, not x * keep: a dropped NaN or inf is 0 under every layout (XLA turns a product by a
    # converted mask into a select only where its fusion sees both, so the product gave NaN in one
    # program and 0 in another; issue 31).
    kept = where(keep, x / (1.0 - rate), 0.0)
    return kept if kept.names == x.names else transpose(kept, x.names)
