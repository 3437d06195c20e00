"""Constant tensors built shard by shard: ``zeros``, ``ones``, ``full``. No device holds more than its block."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from meshdsl.dims import ShapeLike, as_shape
from meshdsl.lowering.context import current
from meshdsl.tensor import Tensor


def full(shape: ShapeLike, value: Any, dtype: Any = jnp.float32) -> Tensor:
    """A tensor of ``shape`` filled with ``value``."""
    with jax.named_scope("md.full"):
        lowering = current()
        shape = as_shape(shape)
        axes = lowering.axes(shape)
        local = [d.size // lowering.group_size(a) for d, a in zip(shape, axes)]
        return lowering.finish(jnp.full(local, value, dtype), shape, axes)


def zeros(shape: ShapeLike, dtype: Any = jnp.float32) -> Tensor:
    """A tensor of ``shape`` filled with 0."""
    return full(shape, 0, dtype)


def ones(shape: ShapeLike, dtype: Any = jnp.float32) -> Tensor:
    """A tensor of ``shape`` filled with 1."""
    return full(shape, 1, dtype)
