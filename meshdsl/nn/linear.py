"""``Linear``: a dense projection from one or more named input dims to one or more output dims."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from meshdsl.errors import ShapeError
from meshdsl.nn.params import (
    Dims,
    Stack,
    as_dims,
    cast_like,
    check_float,
    check_has,
    check_scale,
    dims_of,
    scaled_normal,
    size,
)
from meshdsl.ops.creation import zeros
from meshdsl.ops.einsum import einsum
from meshdsl.tensor import Tensor


@dataclasses.dataclass(frozen=True)
class Linear:
    """``y = x w (+ b)``: ``w[*inputs, *outputs]`` contracts ``x``'s ``inputs`` dims.

    The result has ``x``'s other dims in order, then ``outputs``. A dim of ``w`` beyond those (a
    stack dim left in the parameters, such as ``experts``) must be a dim of ``x``: the two pair up
    entry by entry. Under any layout: a split input dim leaves a pending ``psum``
    (Megatron's row-parallel), a split output dim costs nothing (column-parallel).

    Params: the weight tensor; with ``bias``, ``{"kernel": w, "bias": b[*outputs]}``. Init: normal
    with standard deviation ``init_scale / sqrt(fan_in)``, ``fan_in`` the product of the input
    sizes (LeCun normal; ``init_scale=2**0.5`` is He normal), zero bias.
    """

    inputs: Dims
    outputs: Dims
    _: dataclasses.KW_ONLY
    bias: bool = False
    init_scale: float = 1.0

    def __post_init__(self) -> None:
        ins, outs = as_dims(self.inputs, "Linear inputs"), as_dims(self.outputs, "Linear outputs")
        check_scale("Linear", self.init_scale)
        names = [d.name for d in (*ins, *outs)]
        if len(set(names)) != len(names):
            raise ShapeError(
                f"Linear: inputs {list(map(str, ins))} and outputs {list(map(str, outs))} must have distinct names",
                op="Linear",
            )
        object.__setattr__(self, "inputs", ins)
        object.__setattr__(self, "outputs", outs)

    def init(self, key: jax.Array, stack: Stack = ()) -> Any:
        """The weight ``[*stack, *inputs, *outputs]`` (and, with ``bias``, the zero bias ``[*stack, *outputs]``)."""
        ins, outs = dims_of(self.inputs), dims_of(self.outputs)
        w = scaled_normal(key, [*stack, *ins, *outs], size(ins), self.init_scale)
        return {"kernel": w, "bias": zeros([*stack, *outs])} if self.bias else w

    def __call__(self, params: Any, x: Tensor) -> Tensor:
        check_float("Linear", x)
        w = params["kernel"] if self.bias else params
        ins, outs = dims_of(self.inputs), dims_of(self.outputs)
        check_has("Linear", x, ins, "input")
        extra = [n for n in w.names if n not in x.shape and n not in {d.name for d in outs}]
        if extra:
            raise ShapeError(
                f"Linear: weight {w.shape} has dims {extra} that are neither outputs nor dims of the input {x.shape}",
                op="Linear",
            )
        inputs = {d.name for d in ins}
        out = [d for d in x.shape if d.name not in inputs] + list(outs)
        y = einsum(x, cast_like(w, x), out=out)
        return y + cast_like(params["bias"], x) if self.bias else y
