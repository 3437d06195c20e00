"""``max_pool`` and ``avg_pool``: windows and strides over named dims, with halos over split ones.

``max_pool(x, {"height": 2, "width": 2})`` takes the maximum of every 2 x 2 window, moved by the
window (the default stride) or by ``stride``; "VALID" (the default) or "SAME" padding, as
``lax.reduce_window`` (:mod:`meshdsl.ops.window`). Any number of dims may be pooled; the others
are untouched. The result has ``x``'s dims in order, the pooled ones of their output sizes.

Written once on local blocks, as ``conv2d``: a pooled dim split over axes A whose windows stay
within each device's block (the default, stride = window, when the window divides the block)
needs no communication at all; overlapping windows that line up with the blocks bring their
halo rows with two ``ppermute``\\ s over A (the first and last devices fill the "SAME" padding
with the reduction's identity); windows that drift across blocks gather the dim first.
``avg_pool`` divides the window sums by the number of input entries each window covers
(padding not counted, as TensorFlow and ``flax.linen.avg_pool(count_include_pad=False)``); a
constant, each device dividing its own block.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshdsl.dims import Dim, DimLike, Shape
from meshdsl.errors import ShapeError
from meshdsl.lowering.context import current, naming, op
from meshdsl.ops.window import Window, extend
from meshdsl.tensor import Tensor, tensor

WindowSpec = Mapping[DimLike, int]


def _windows(name: str, x: Tensor, window: WindowSpec, stride: WindowSpec | None, padding: str) -> dict[str, Window]:
    sizes = {(d.name if isinstance(d, Dim) else d): k for d, k in window.items()}
    steps = sizes if stride is None else {(d.name if isinstance(d, Dim) else d): s for d, s in stride.items()}
    if not sizes:
        raise ShapeError(f"{name}: no dims to pool; window maps dim names to window sizes", op=name)
    if set(steps) != set(sizes):
        raise ShapeError(
            f"{name}: stride names {sorted(steps)}, window names {sorted(sizes)}; they must be the same dims", op=name
        )
    for n in sizes:
        if n not in x.shape:
            raise ShapeError(f"{name}: input {x.shape} has no dim {n!r}", op=name)
    return {n: Window.checked(name, n, x.shape[n].size, k, steps[n], padding) for n, k in sizes.items()}


def _pool(name: str, x: Tensor, windows: dict[str, Window], init: float, reducer: Callable) -> Tensor:
    lowering = current()
    out = Shape(Dim(d.name, windows[d.name].out) if d.name in windows else d for d in x.shape)
    with naming(name):
        lowering.axes(out, f"{name} result")  # a clear LayoutError if the layout cannot hold the result
    axes = list(lowering.axes(x.shape))
    for i, n in enumerate(x.shape.names):  # windows a halo cannot serve: gather the dim instead
        if n in windows and axes[i] and windows[n].halo(lowering.group_size(axes[i])) is None:
            axes[i] = ()
    # XLA's partitioner also miscomputes a max pool's gradient split along a window (gspmd; as conv2d).
    a = lowering.hold_whole(lowering.prepare(x, tuple(axes)), x.shape, list(windows))
    pads = [(0, 0)] * a.ndim
    for i, n in enumerate(x.shape.names):
        if n not in windows:
            continue
        if axes[i]:
            halo = windows[n].halo(lowering.group_size(axes[i]))
            assert halo is not None  # the dims a halo cannot serve were gathered above
            before, after = halo
            with jax.named_scope(str(x.shape)):  # md.explain's tensor column
                a = extend(lowering, a, axes[i], i, before, after, init)
        else:
            pads[i] = (windows[n].lo, windows[n].hi)
    dims = [windows[n].window if n in windows else 1 for n in x.shape.names]
    strides = [windows[n].stride if n in windows else 1 for n in x.shape.names]
    y = lax.reduce_window(
        a, np.asarray(init, a.dtype), reducer, dims, strides, pads
    )  # concrete: the differentiable max or sum
    return lowering.finish(lowering.hold_whole(y, out, list(windows)), out, tuple(axes))


@op("max_pool")
def max_pool(x: Tensor, window: WindowSpec, stride: WindowSpec | None = None, padding: str = "VALID") -> Tensor:
    """Maximum over windows: ``window`` and ``stride`` map dim names to sizes (``stride`` None: the window)."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ShapeError(f"max_pool: input must be floating point, got {x.dtype}", op="max_pool")
    return _pool("max_pool", x, _windows("max_pool", x, window, stride, padding), -np.inf, lax.max)


@op("avg_pool")
def avg_pool(x: Tensor, window: WindowSpec, stride: WindowSpec | None = None, padding: str = "VALID") -> Tensor:
    """Mean over windows of the entries they cover (padding not counted); arguments as :func:`max_pool`."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ShapeError(f"avg_pool: input must be floating point, got {x.dtype}", op="avg_pool")
    windows = _windows("avg_pool", x, window, stride, padding)
    total = _pool("avg_pool", x, windows, 0.0, lax.add)
    if all(w.lo == 0 and w.hi == 0 for w in windows.values()):
        return total / float(math.prod(w.window for w in windows.values()))
    grid = functools.reduce(np.multiply.outer, [_covered(w) for w in windows.values()])
    return total / tensor(jnp.asarray(grid, x.dtype), [Dim(n, w.out) for n, w in windows.items()])


def _covered(w: Window) -> np.ndarray:
    """Per output row, how many of its window's rows are input rows (not padding)."""
    start = np.arange(w.out) * w.stride - w.lo
    return (np.minimum(start + w.window, w.size) - np.maximum(start, 0)).astype(np.float64)
