"""What every layer shares: dims given one or several at a time, and the scaled-normal init."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from meshdsl import random
from meshdsl.arguments import number
from meshdsl.dims import Dim
from meshdsl.errors import ShapeError
from meshdsl.ops.elementwise import cast
from meshdsl.tensor import Tensor, describe

Dims = Dim | Sequence[Dim]
Stack = Sequence[Dim]
"""Dims put in front of every parameter a layer makes: a stack of identical layers that ``md.scan``
runs one slice at a time (``[layers]``), or of experts (``[experts]``). One draw makes the whole
stack, so its slices differ."""


def as_dims(dims: Dims, what: str) -> tuple[Dim, ...]:
    """``dims`` as a tuple of Dims (one Dim, or a sequence of them); ShapeError naming ``what`` otherwise."""
    out = (dims,) if isinstance(dims, Dim) else tuple(dims) if isinstance(dims, (list, tuple)) else ()
    if not out or not all(isinstance(d, Dim) for d in out):
        raise ShapeError(
            f"{what}: expected an md.Dim or a non-empty sequence of md.Dims (sizes are needed), got {dims!r}", op=what
        )
    check_sizes(what, out)
    return out


def check_sizes(what: str, dims: Sequence[Dim]) -> None:
    """ShapeError naming ``what`` unless every dim of ``dims`` is an md.Dim of size at least 1 (a size-0
    dim makes an empty weight: its init divides by a fan-in of 0, its output is silently all zeros)."""
    for d in dims:
        if not isinstance(d, Dim):
            raise ShapeError(f"{what}: expected an md.Dim (sizes are needed), got {d!r}", op=what)
        if d.size < 1:
            raise ShapeError(f"{what}: dim {d} has size {d.size}; a layer's dims need a size of at least 1", op=what)


def check_float(layer: str, x: Tensor) -> None:
    """ShapeError unless the input ``x`` is floating: layers compute in their input's dtype, so integer
    inputs would cast the weights to integers (mostly zeros) and return zeros."""
    if not isinstance(x, Tensor):
        raise ShapeError(f"{layer}: input must be an md tensor, got {describe(x)}", op=layer)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ShapeError(
            f"{layer}: input {x.shape} is {x.dtype}, but a layer computes in its input's float dtype; "
            "cast it first (md.cast(x, 'float32')), or look integer ids up with md.nn.Embedding",
            op=layer,
        )


def check_scale(layer: str, init_scale: float) -> None:
    """ConfigError unless ``init_scale`` is a finite number of at least 0 (0: zero weights)."""
    number(init_scale, f"{layer}: init_scale", at_least=0.0, op=layer)


def scaled_normal(key: jax.Array, dims: Sequence[Dim], fan_in: int, scale: float) -> Tensor:
    """Normal values with standard deviation ``scale / sqrt(fan_in)`` (LeCun normal at ``scale`` 1, He at
    ``sqrt(2)``)."""
    return random.normal(key, list(dims)) * (scale * fan_in**-0.5)


def dims_of(dims: Dims) -> tuple[Dim, ...]:
    """A layer's dims field as the tuple its ``__post_init__`` stored there (by :func:`as_dims`): the field's
    declared type is what the constructor accepts, one Dim or a sequence, so this says which it holds now."""
    return (dims,) if isinstance(dims, Dim) else tuple(dims)


def size(dims: Sequence[Dim]) -> int:
    return math.prod(d.size for d in dims)


def check_has(layer: str, x: Tensor, dims: Sequence[Dim], role: str) -> None:
    """ShapeError unless ``x`` has every dim of ``dims`` (by name and size)."""
    for d in dims:
        if d.name not in x.shape or x.shape[d.name].size != d.size:
            raise ShapeError(f"{layer}: input {x.shape} needs the {role} dim {d}", op=layer)


def cast_like(p: Tensor, x: Tensor) -> Tensor:
    """Parameter ``p`` in the dtype of ``x`` (layers compute in their input's dtype)."""
    return p if p.dtype == x.dtype else cast(p, x.dtype)
