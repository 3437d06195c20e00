"""Constant tensors built shard by shard: ``zeros``, ``ones``, ``full``. No device holds more than its block."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from meshdsl.dims import ShapeLike, as_shape
from meshdsl.errors import ShapeError
from meshdsl.lowering.context import current, op
from meshdsl.tensor import Tensor, describe, dtype_of


@op("full")
def full(shape: ShapeLike, value: Any, dtype: Any = jnp.float32) -> Tensor:
    """A tensor of ``shape`` filled with ``value``."""
    dtype = dtype_of(dtype, "full")
    if not isinstance(value, (bool, int, float, complex, np.number, np.bool_)) and not (
        hasattr(value, "shape") and value.shape == ()
    ):
        raise ShapeError(f"full: value must be a number, got {describe(value)}", op="full")
    lowering = current()
    shape = as_shape(shape)
    axes = lowering.axes(shape)
    local = [d.size // lowering.group_size(a) for d, a in zip(shape, axes)]
    return lowering.finish(jnp.full(local, value, dtype), shape, axes)


def zeros(shape: ShapeLike, dtype: Any = jnp.float32) -> Tensor:
    """A tensor of ``shape`` filled with 0."""
    return full(shape, 0, dtype_of(dtype, "zeros"))


def ones(shape: ShapeLike, dtype: Any = jnp.float32) -> Tensor:
    """A tensor of ``shape`` filled with 1."""
    return full(shape, 1, dtype_of(dtype, "ones"))
