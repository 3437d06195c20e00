"""``MLP``: the feed-forward block, ``activation(x w_in) w_out``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from meshdsl.errors import ConfigError
from meshdsl.nn.linear import Linear
from meshdsl.nn.params import Dims, Stack, as_dims, check_float
from meshdsl.ops.elementwise import gelu
from meshdsl.tensor import Tensor


@dataclasses.dataclass(frozen=True)
class MLP:
    """``activation(x w_in (+ b_in)) w_out (+ b_out)``: ``inputs -> hidden -> outputs`` (``outputs``
    default: ``inputs``, the Transformer's feed-forward).

    Splitting ``hidden`` is Megatron's feed-forward: the first projection is local, the second
    leaves one pending ``psum``. Params: ``{"w_in": input_projection's, "w_out":
    output_projection's}`` (``Linear``'s: a weight, or ``{"kernel", "bias"}`` with ``bias``).
    """

    inputs: Dims
    hidden: Dims
    outputs: Dims | None = None
    _: dataclasses.KW_ONLY
    activation: Callable[[Tensor], Tensor] = gelu
    bias: bool = False

    def __post_init__(self) -> None:
        name = type(self).__name__
        if not callable(self.activation):
            raise ConfigError(
                f"{name}: activation must be a function of an md tensor (e.g. md.relu, md.gelu), "
                f"got {self.activation!r}",
                op=name,
            )
        object.__setattr__(self, "inputs", as_dims(self.inputs, f"{name} inputs"))
        object.__setattr__(self, "hidden", as_dims(self.hidden, f"{name} hidden"))
        outputs = self.inputs if self.outputs is None else as_dims(self.outputs, f"{name} outputs")
        object.__setattr__(self, "outputs", outputs)

    @property
    def input_projection(self) -> Linear:
        """``inputs -> hidden`` (GatedMLP's gate and up projections have this shape too)."""
        return Linear(self.inputs, self.hidden, bias=self.bias)

    @property
    def output_projection(self) -> Linear:
        return Linear(self.hidden, self.inputs if self.outputs is None else self.outputs, bias=self.bias)

    def init(self, key: jax.Array, stack: Stack = ()) -> dict[str, Any]:
        k_in, k_out = jax.random.split(key)
        return {"w_in": self.input_projection.init(k_in, stack), "w_out": self.output_projection.init(k_out, stack)}

    def __call__(self, params: dict[str, Any], x: Tensor) -> Tensor:
        check_float("MLP", x)
        hidden = self.activation(self.input_projection(params["w_in"], x))
        return self.output_projection(params["w_out"], hidden)
