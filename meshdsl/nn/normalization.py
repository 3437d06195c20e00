"""``LayerNorm`` and ``RMSNorm`` over one or more named dims, with a learnable scale (and LayerNorm's bias)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from meshdsl.arguments import number
from meshdsl.nn.params import Dims, Stack, as_dims, cast_like, check_float, check_has, dims_of
from meshdsl.ops.creation import ones, zeros
from meshdsl.ops.elementwise import rsqrt, square
from meshdsl.ops.reduction import reduce_mean
from meshdsl.tensor import Tensor


@dataclasses.dataclass(frozen=True)
class RMSNorm:
    """``x / sqrt(mean(x^2 over dims) + eps) * scale`` (Zhang and Sennrich, 2019; T5's norm).

    Over a split dim the mean costs one ``psum`` (of a tensor without ``dims``). Params: the scale
    ``[*dims]``, initialised to ones. ``offset``: the scale is stored minus it and applied as
    ``offset + scale`` (Gemma's ``(1 + w)`` at 1.0; initialised to ``1 - offset``).
    """

    dims: Dims
    _: dataclasses.KW_ONLY
    eps: float = 1e-6
    offset: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "dims", as_dims(self.dims, "RMSNorm dims"))
        number(self.eps, "RMSNorm: eps", at_least=0.0, op="RMSNorm")
        number(self.offset, "RMSNorm: offset", op="RMSNorm")

    def init(self, key: jax.Array | None = None, stack: Stack = ()) -> Tensor:
        """``1 - offset`` (ones) ``[*stack, *dims]`` (``key`` is not used: the init is constant)."""
        return ones([*stack, *dims_of(self.dims)]) * (1.0 - self.offset)

    def __call__(self, scale: Tensor, x: Tensor) -> Tensor:
        check_float("RMSNorm", x)
        check_has("RMSNorm", x, dims_of(self.dims), "normalized")
        scale = cast_like(scale, x) + self.offset if self.offset else cast_like(scale, x)
        return x * rsqrt(reduce_mean(square(x), list(dims_of(self.dims))) + self.eps) * scale


@dataclasses.dataclass(frozen=True)
class LayerNorm:
    """``(x - mean) / sqrt(var + eps) * scale (+ bias)``, mean and variance over ``dims`` (Ba et al., 2016).

    Params: the scale ``[*dims]`` (ones); with ``bias`` (the default), ``{"scale", "bias"}`` (zeros).
    """

    dims: Dims
    _: dataclasses.KW_ONLY
    eps: float = 1e-6
    bias: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "dims", as_dims(self.dims, "LayerNorm dims"))
        number(self.eps, "LayerNorm: eps", at_least=0.0, op="LayerNorm")

    def init(self, key: jax.Array | None = None, stack: Stack = ()) -> Any:
        """Ones ``[*stack, *dims]`` (and zeros for the bias); ``key`` is not used."""
        scale = ones([*stack, *dims_of(self.dims)])
        return {"scale": scale, "bias": zeros([*stack, *dims_of(self.dims)])} if self.bias else scale

    def __call__(self, params: Any, x: Tensor) -> Tensor:
        check_float("LayerNorm", x)
        check_has("LayerNorm", x, dims_of(self.dims), "normalized")
        scale = params["scale"] if self.bias else params
        dims = list(dims_of(self.dims))
        x = x - reduce_mean(x, dims)
        y = x * rsqrt(reduce_mean(square(x), dims) + self.eps) * cast_like(scale, x)
        return y + cast_like(params["bias"], x) if self.bias else y
