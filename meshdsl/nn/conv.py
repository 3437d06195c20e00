"""``Conv2d``: a 2-d convolution layer over named spatial dims, with stride and "SAME" or "VALID" padding."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from meshdsl.dims import Dim
from meshdsl.errors import ShapeError
from meshdsl.nn.params import Stack, cast_like, check_float, check_scale, check_sizes, scaled_normal
from meshdsl.ops.conv import conv2d
from meshdsl.ops.creation import zeros
from meshdsl.tensor import Tensor


@dataclasses.dataclass(frozen=True)
class Conv2d:
    """``md.conv2d(x, kernel) (+ bias)``: ``x[*batch, height, width, in_channels]`` to the same dims
    with ``out_channels`` in place of ``in_channels`` and the spatial dims of their output sizes.

    A split ``height`` or ``width`` exchanges halos (or is gathered where windows drift across
    blocks: ``md.conv2d``); a split ``in_channels`` leaves a pending ``psum``; a split
    ``out_channels`` costs nothing.

    Params: ``{"kernel": [kh, kw, in_channels, out_channels], "bias": [out_channels]}`` (the kernel
    alone without ``bias``). Init: normal with standard deviation ``init_scale / sqrt(kh kw
    in_channels)`` (``init_scale=2**0.5``: He normal, for a relu after it), zero bias.
    """

    in_channels: Dim
    out_channels: Dim
    kernel: tuple[int, int] = (3, 3)
    _: dataclasses.KW_ONLY
    stride: tuple[int, int] = (1, 1)
    padding: str = "SAME"
    bias: bool = True
    height: str = "height"
    width: str = "width"
    kernel_height: str = "kh"
    kernel_width: str = "kw"
    init_scale: float = 1.0

    def __post_init__(self) -> None:
        check_sizes("Conv2d channels", [self.in_channels, self.out_channels])
        for what, pair in (("kernel", self.kernel), ("stride", self.stride)):
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(_positive_int(n) for n in pair)):
                raise ShapeError(
                    f"Conv2d: {what} must be a pair of positive ints (height, width), got {pair!r}", op="Conv2d"
                )
            object.__setattr__(self, what, tuple(int(n) for n in pair))
        check_scale("Conv2d", self.init_scale)
        names = [
            self.in_channels.name,
            self.out_channels.name,
            self.height,
            self.width,
            self.kernel_height,
            self.kernel_width,
        ]
        if len(set(names)) != len(names):
            raise ShapeError(f"Conv2d: dim names {names} must be distinct", op="Conv2d")

    @property
    def kernel_dims(self) -> list[Dim]:
        return [
            Dim(self.kernel_height, self.kernel[0]),
            Dim(self.kernel_width, self.kernel[1]),
            self.in_channels,
            self.out_channels,
        ]

    def init(self, key: jax.Array, stack: Stack = ()) -> Any:
        fan_in = self.kernel[0] * self.kernel[1] * self.in_channels.size
        kernel = scaled_normal(key, [*stack, *self.kernel_dims], fan_in, self.init_scale)
        return {"kernel": kernel, "bias": zeros([*stack, self.out_channels])} if self.bias else kernel

    def __call__(self, params: Any, x: Tensor) -> Tensor:
        check_float("Conv2d", x)
        kernel = params["kernel"] if self.bias else params
        y = conv2d(
            x,
            cast_like(kernel, x),
            self.height,
            self.width,
            self.in_channels,
            self.out_channels,
            self.kernel_height,
            self.kernel_width,
            padding=self.padding,
            stride=self.stride,
        )
        return y + cast_like(params["bias"], x) if self.bias else y


def _positive_int(n: Any) -> bool:
    return bool(isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 1)
