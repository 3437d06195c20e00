"""``GatedMLP``: the gated feed-forward block, ``(activation(x w_gate) * x w_in) w_out`` (SwiGLU, GeGLU)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from meshdsl.nn.linear import Linear
from meshdsl.nn.params import Dims, Stack, as_dims
from meshdsl.ops.elementwise import silu
from meshdsl.tensor import Tensor


@dataclasses.dataclass(frozen=True)
class GatedMLP:
    """``(activation(x w_gate) * (x w_in)) w_out``: ``inputs -> hidden -> outputs`` (Shazeer, 2020).

    ``activation=md.silu`` (the default) is SwiGLU, LLaMA's feed-forward; ``md.gelu`` is GeGLU.
    Splitting ``hidden`` is Megatron's feed-forward: both input projections and the gate are local,
    the output projection leaves one pending ``psum``. Params: ``{"w_gate", "w_in", "w_out"}``
    (``Linear`` weights, LeCun normal; ``{"kernel", "bias"}`` each with ``bias``): Hugging Face's
    ``gate_proj``, ``up_proj`` and ``down_proj``.
    """

    inputs: Dims
    hidden: Dims
    outputs: Dims | None = None
    _: dataclasses.KW_ONLY
    activation: Callable[[Tensor], Tensor] = silu
    bias: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", as_dims(self.inputs, "GatedMLP inputs"))
        object.__setattr__(self, "hidden", as_dims(self.hidden, "GatedMLP hidden"))
        outputs = self.inputs if self.outputs is None else as_dims(self.outputs, "GatedMLP outputs")
        object.__setattr__(self, "outputs", outputs)

    @property
    def input_projection(self) -> Linear:
        """``inputs -> hidden``: the gate's and the up projection's shape."""
        return Linear(self.inputs, self.hidden, bias=self.bias)

    @property
    def output_projection(self) -> Linear:
        return Linear(self.hidden, self.inputs if self.outputs is None else self.outputs, bias=self.bias)

    def init(self, key: jax.Array, stack: Stack = ()) -> dict[str, Any]:
        k_gate, k_in, k_out = jax.random.split(key, 3)
        return {
            "w_gate": self.input_projection.init(k_gate, stack),
            "w_in": self.input_projection.init(k_in, stack),
            "w_out": self.output_projection.init(k_out, stack),
        }

    def __call__(self, params: dict[str, Any], x: Tensor) -> Tensor:
        gate = self.activation(self.input_projection(params["w_gate"], x))
        return self.output_projection(params["w_out"], gate * self.input_projection(params["w_in"], x))
