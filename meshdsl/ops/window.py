"""Sliding windows along named dims, on local blocks: the geometry shared by ``conv2d`` and pooling.

Along one dim of ``size`` rows, a window of ``window`` rows moved by ``stride`` with ``padding``
(XLA's conventions, as ``lax.conv_general_dilated`` and ``lax.reduce_window``):

* ``"VALID"``: ``out = (size - window) // stride + 1`` windows, no padding;
* ``"SAME"``: ``out = ceil(size / stride)``, padded by ``total = max((out - 1) stride + window - size, 0)``
  rows, ``lo = total // 2`` before and the rest after.

Output row ``i`` reads input rows ``i stride - lo ... i stride - lo + window - 1``. Split over ``p``
devices, device ``d`` holds input rows ``d b ... d b + b - 1`` (``b = size / p``) and output rows
``d c ... d c + c - 1`` (``c = out / p``), so it needs input rows from ``d c stride - lo`` on:
``(c - 1) stride + window`` of them. When ``c stride = b`` (each device's output comes from its own
block), that is its block, plus ``lo`` rows of the previous block and ``window - stride - lo`` of
the next: a halo, the same count on every device, brought by two ``ppermute``\\ s. The first and
last devices receive the padding. Otherwise (the windows drift across blocks: a stride that does
not divide the block, or ``"VALID"`` with windows wider than the stride), or when a halo is
longer than a block, the op gathers the dim and computes on the whole of it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from meshdsl.errors import ShapeError

PADDINGS = ("SAME", "VALID")


@dataclasses.dataclass(frozen=True)
class Window:
    """One dim's sliding window: ``size`` input rows, ``window`` rows per window, moved by ``stride``."""

    size: int
    window: int
    stride: int
    padding: str

    @classmethod
    def checked(cls, op: str, dim: str, size: int, window: int, stride: int, padding: str) -> Window:
        """The window, or a ShapeError naming ``op`` and ``dim`` when it cannot slide over ``size`` rows."""
        if padding not in PADDINGS:
            raise ShapeError(f"{op}: padding {padding!r} is not one of {', '.join(PADDINGS)}", op=op)
        if window < 1 or stride < 1:
            raise ShapeError(f"{op}: window {window} and stride {stride} along {dim} must be at least 1", op=op)
        if padding == "VALID" and window > size:
            raise ShapeError(
                f"{op}: window {window} is longer than {dim}={size}; 'VALID' needs at least one whole window", op=op
            )
        return cls(size, window, stride, padding)

    @property
    def out(self) -> int:
        """Number of output rows."""
        if self.padding == "VALID":
            return (self.size - self.window) // self.stride + 1
        return -(-self.size // self.stride)

    @property
    def lo(self) -> int:
        """Padding rows before the first input row."""
        return 0 if self.padding == "VALID" else max((self.out - 1) * self.stride + self.window - self.size, 0) // 2

    @property
    def hi(self) -> int:
        """Padding rows after the last input row that some window reads."""
        return max((self.out - 1) * self.stride + self.window - self.size - self.lo, 0)

    def halo(self, parts: int) -> tuple[int, int] | None:
        """``(before, after)``: rows of the previous and next block each of ``parts`` blocks needs, or
        None when a halo cannot serve the split (the windows drift across blocks, or reach past a
        neighbour's block)."""
        block, out_block = self.size // parts, self.out // parts
        if out_block * parts != self.out or out_block * self.stride != block:
            return None
        before, after = self.lo, max(self.window - self.stride - self.lo, 0)
        return (before, after) if before <= block and after <= block else None


def extend(
    lowering: Any, a: jax.Array, axes: tuple[str, ...], axis: int, before: int, after: int, fill: float
) -> jax.Array:
    """``a`` (a block of a dim split over ``axes`` at position ``axis``) with ``before`` rows of the
    previous block and ``after`` rows of the next added; ``fill`` beyond the first and last blocks."""
    n = a.shape[axis]
    parts = [a]
    if before:
        rows = lowering.ppermute(lax.slice_in_dim(a, n - before, n, axis=axis), axes, 1, False)
        first = lowering.axis_index(axes) == 0
        parts.insert(0, jnp.where(first, jnp.asarray(fill, a.dtype), rows) if fill else rows)
    if after:
        rows = lowering.ppermute(lax.slice_in_dim(a, 0, after, axis=axis), axes, -1, False)
        last = lowering.axis_index(axes) == lowering.group_size(axes) - 1
        parts.append(jnp.where(last, jnp.asarray(fill, a.dtype), rows) if fill else rows)
    return jnp.concatenate(parts, axis=axis) if len(parts) > 1 else a
