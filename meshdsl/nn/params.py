"""What every layer shares: dims given one or several at a time, and the scaled-normal init."""

from __future__ import annotations

import math
from typing import Sequence, Union

import jax

from meshdsl import random
from meshdsl.dims import Dim
from meshdsl.errors import ShapeError
from meshdsl.ops.elementwise import cast
from meshdsl.tensor import Tensor

Dims = Union[Dim, Sequence[Dim]]
Stack = Sequence[Dim]
"""Dims put in front of every parameter a layer makes: a stack of identical layers that ``md.scan``
runs one slice at a time (``[layers]``), or of experts (``[experts]``). One draw makes the whole
stack, so its slices differ."""


def as_dims(dims: Dims, what: str) -> tuple[Dim, ...]:
    """``dims`` as a tuple of Dims (one Dim, or a sequence of them); ShapeError naming ``what`` otherwise."""
    out = (dims,) if isinstance(dims, Dim) else tuple(dims) if isinstance(dims, (list, tuple)) else ()
    if not out or not all(isinstance(d, Dim) for d in out):
        raise ShapeError(f"{what}: expected an md.Dim or a non-empty sequence of md.Dims (sizes are needed), got {dims!r}")
    return out


def scaled_normal(key: jax.Array, dims: Sequence[Dim], fan_in: int, scale: float) -> Tensor:
    """Normal values with standard deviation ``scale / sqrt(fan_in)`` (LeCun normal at ``scale`` 1, He at ``sqrt(2)``)."""
    return random.normal(key, list(dims)) * (scale * fan_in**-0.5)


def size(dims: Sequence[Dim]) -> int:
    return math.prod(d.size for d in dims)


def check_has(layer: str, x: Tensor, dims: Sequence[Dim], role: str) -> None:
    """ShapeError unless ``x`` has every dim of ``dims`` (by name and size)."""
    for d in dims:
        if d.name not in x.shape or x.shape[d.name].size != d.size:
            raise ShapeError(f"{layer}: input {x.shape} needs the {role} dim {d}")


def cast_like(p: Tensor, x: Tensor) -> Tensor:
    """Parameter ``p`` in the dtype of ``x`` (layers compute in their input's dtype)."""
    return p if p.dtype == x.dtype else cast(p, x.dtype)
