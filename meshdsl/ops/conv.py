"""``conv2d``: 2-d convolution by dim name, with halo exchange over split spatial dims.

``conv2d(x[batch, height, width, channels], kernel[kh, kw, channels, out_channels])`` is
``out[b, i, j, o] = sum_{u, v, c} xpad[b, i sh + u, j sw + v, c] kernel[u, v, c, o]`` with strides
``(sh, sw)`` and "SAME" or "VALID" padding (XLA's conventions; see :mod:`meshdsl.ops.window`). The
result is ``x``'s shape with ``channels`` replaced by ``out_channels`` in place, and ``height`` and
``width`` of their output sizes (``ceil(n / s)`` for "SAME", ``(n - k) // s + 1`` for "VALID").
Every dim of ``x`` other than the two spatial ones and the input channels is a batch dim (any
number of them, in any order).

Written once on local blocks, like the other ops:

* A spatial dim split over axes A, when each device's output rows read its own block and the
  edges of its neighbours' (the stride divides the block: ``Window.halo``): each device needs
  ``lo`` rows of the previous block and ``k - s - lo`` of the next (for stride 1 "SAME",
  ``(k - 1) / 2`` each). They come with two ``ppermute``\\ s over A (a halo exchange:
  only the boundary rows move, not the whole dim as an ``all_gather`` would); the first and last
  devices receive zeros, which are the "SAME" padding. The local conv then runs "VALID" along
  that dim with the stride. Strided "VALID" windows no wider than the stride (patches) need no
  rows at all. Otherwise (windows drifting across blocks, or a halo longer than a block) the dim
  is gathered. With both spatial dims split the width exchange runs on the height-extended block,
  so the corners come along.
* An unsplit spatial dim: the local conv pads it itself. On global arrays (eager and gspmd)
  nothing is split, so the same code is the plain global convolution.
* ``channels`` split over B: the local conv of the local channel blocks is a partial sum,
  left pending over B (added lazily, as ``einsum``).
* ``out_channels`` split: the kernel's local block gives the output's local block.
* Two dims of the operands split over one mesh axis: ``compute_split.choose`` picks the one that
  keeps it, as for ``einsum``. ``kh``/``kw`` splits are gathered (they are tiny).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshdsl.dims import Dim, DimLike, Shape
from meshdsl.errors import ShapeError
from meshdsl.lowering import compute_split
from meshdsl.lowering.context import current, naming, op
from meshdsl.ops.window import Window, extend
from meshdsl.tensor import Tensor


def _name(d: DimLike) -> str:
    return d.name if isinstance(d, Dim) else d


@op("conv2d")
def conv2d(
    x: Tensor,
    kernel: Tensor,
    height: DimLike = "height",
    width: DimLike = "width",
    in_dim: DimLike = "channels",
    out_dim: DimLike = "out_channels",
    kernel_height: DimLike = "kh",
    kernel_width: DimLike = "kw",
    padding: str = "SAME",
    stride: int | tuple[int, int] = 1,
) -> Tensor:
    """2-d convolution of ``x`` (dims ``height``, ``width``, ``in_dim`` and batch dims) with
    ``kernel`` (dims ``kernel_height``, ``kernel_width``, ``in_dim``, ``out_dim``, any order).

    ``padding``: "SAME" or "VALID"; ``stride``: one int or ``(height, width)``. Returns ``x``'s
    shape with ``in_dim`` replaced by ``out_dim`` and the spatial dims of their output sizes.
    """
    h, w, c, o, kh, kw = map(_name, (height, width, in_dim, out_dim, kernel_height, kernel_width))
    strides = (stride, stride) if isinstance(stride, int) else tuple(stride)
    if len(strides) != 2:
        raise ShapeError(f"conv2d: stride {stride!r} is one int or (height, width)", op="conv2d")
    if len({h, w, c}) != 3:
        raise ShapeError(
            f"conv2d: height {h!r}, width {w!r} and in_dim {c!r} must be three different dims of the input {x.shape}",
            op="conv2d",
        )
    if len({kh, kw, c, o}) != 4:
        raise ShapeError(
            f"conv2d: kernel_height {kh!r}, kernel_width {kw!r}, in_dim {c!r} and out_dim {o!r} must be four "
            "different names",
            op="conv2d",
        )
    if sorted(kernel.shape.names) != sorted({kh, kw, c, o}):
        raise ShapeError(f"conv2d: kernel {kernel.shape} must have exactly the dims {kh}, {kw}, {c}, {o}", op="conv2d")
    for name in (h, w, c):
        if name not in x.shape:
            raise ShapeError(f"conv2d: input {x.shape} has no dim {name!r}", op="conv2d")
    if x.shape[c].size != kernel.shape[c].size:
        raise ShapeError(f"conv2d: {c} is {x.shape[c]} in the input but {kernel.shape[c]} in the kernel", op="conv2d")
    for role, name in (("out_dim", o), ("kernel_height", kh), ("kernel_width", kw)):
        if name in x.shape:
            raise ShapeError(
                f"conv2d: {role} {name!r} is also a dim of the input {x.shape}; name the kernel's dims differently",
                op="conv2d",
            )
    sizes = {h: kernel.shape[kh].size, w: kernel.shape[kw].size}
    windows = {n: Window.checked("conv2d", n, x.shape[n].size, sizes[n], s, padding) for n, s in zip((h, w), strides)}

    lowering = current()
    out = Shape(
        kernel.shape[o] if d.name == c else Dim(d.name, windows[d.name].out) if d.name in windows else d
        for d in x.shape
    )
    with naming("conv2d"):
        lowering.axes(out, "conv2d result")  # a clear LayoutError if the layout cannot hold the result
    batch = [n for n in x.shape.names if n not in (h, w, c)]

    def result(split: compute_split.NameAxes):
        return tuple(split[n] for n in out.names), split[c]

    itemsize = np.dtype(jnp.result_type(x.dtype, kernel.dtype)).itemsize
    split = dict(compute_split.choose(lowering, [x, kernel], out, result, itemsize))
    split[kh] = split[kw] = ()
    for name in (h, w):  # windows a halo cannot serve: gather the dim instead
        if split[name] and windows[name].halo(lowering.group_size(split[name])) is None:
            split[name] = ()

    # Where XLA partitions the program (gspmd), its partitioner miscomputes convolutions split
    # along a windowed dim (docs/design.md, gspmd): there the convolution holds those dims whole.
    windowed = [n for n in (h, w) if sizes[n] > 1 or windows[n].stride > 1]
    xa = lowering.hold_whole(
        lowering.prepare(x, tuple(split[n] for n in x.shape.names), beside=[kernel]), x.shape, windowed
    )
    ka = lowering.prepare(kernel, tuple(split[n] for n in kernel.shape.names), beside=[x])
    # Local NHWC / HWIO arrays: the batch dims flattened into one.
    order = [*batch, h, w, c]
    xa = jnp.transpose(xa, [x.shape.index(n) for n in order])
    local_batch = xa.shape[: len(batch)]
    xa = jnp.reshape(xa, (int(np.prod(local_batch)), *xa.shape[len(batch) :]))
    ka = jnp.transpose(ka, [kernel.shape.index(n) for n in (kh, kw, c, o)])
    pads = []
    for axis, name in ((1, h), (2, w)):
        window = windows[name]
        if split[name]:
            halo = window.halo(lowering.group_size(split[name]))
            assert halo is not None  # the dims a halo cannot serve were gathered above
            before, after = halo
            with jax.named_scope(str(x.shape)):  # md.explain's tensor column
                xa = extend(lowering, xa, split[name], axis, before, after, 0.0)
            pads.append((0, 0))
        else:
            pads.append((window.lo, window.hi))
    xa, ka = lowering.vary_like(xa, ka), lowering.vary_like(ka, xa)
    y = lax.conv_general_dilated(xa, ka, strides, pads, dimension_numbers=("NHWC", "HWIO", "NHWC"))
    y = jnp.reshape(y, (*local_batch, *y.shape[1:]))
    y = lowering.hold_whole(jnp.transpose(y, [order.index(c if n == o else n) for n in out.names]), out, windowed)
    out_axes, pending = result(split)
    return lowering.finish(y, out, out_axes, pending, lazy=True)
