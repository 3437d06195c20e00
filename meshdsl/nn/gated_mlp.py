"""``GatedMLP``: the gated feed-forward block, ``(activation(x w_gate) * x w_in) w_out`` (SwiGLU, GeGLU)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax

from meshdsl.errors import ConfigError
from meshdsl.nn.mlp import MLP
from meshdsl.nn.params import Stack, check_float
from meshdsl.ops.elementwise import silu
from meshdsl.tensor import Tensor


@dataclasses.dataclass(frozen=True)
class GatedMLP(MLP):
    """``(activation(x w_gate) * (x w_in)) w_out``: ``inputs -> hidden -> outputs`` (Shazeer, 2020).

    An :class:`MLP` with a third projection, the gate: the same fields, checks and projections.
    ``activation=md.silu`` (the default) is SwiGLU, LLaMA's feed-forward; ``md.gelu`` is GeGLU.
    Splitting ``hidden`` is Megatron's feed-forward: both input projections and the gate are local,
    the output projection leaves one pending ``psum``. Params: ``{"w_gate", "w_in", "w_out"}``
    (``Linear`` weights, LeCun normal; ``{"kernel", "bias"}`` each with ``bias``): Hugging Face's
    ``gate_proj``, ``up_proj`` and ``down_proj``.
    """

    _: dataclasses.KW_ONLY
    activation: Callable[[Tensor], Tensor] = silu

    def init(self, key: jax.Array, stack: Stack = ()) -> dict[str, Any]:
        k_gate, k_in, k_out = jax.random.split(key, 3)
        return {
            "w_gate": self.input_projection.init(k_gate, stack),
            "w_in": self.input_projection.init(k_in, stack),
            "w_out": self.output_projection.init(k_out, stack),
        }

    def __call__(self, params: dict[str, Any], x: Tensor) -> Tensor:
        check_float("GatedMLP", x)
        if not isinstance(params, Mapping) or not {"w_gate", "w_in", "w_out"} <= set(params):
            have = sorted(params) if isinstance(params, Mapping) else type(params).__name__
            raise ConfigError(f"GatedMLP: params must be a dict with w_gate, w_in and w_out (its init's), got {have}")
        gate = self.activation(self.input_projection(params["w_gate"], x))
        return self.output_projection(params["w_out"], gate * self.input_projection(params["w_in"], x))
