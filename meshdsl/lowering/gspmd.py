"""The gspmd lowering: ops on global arrays, each result constrained to its layout's sharding.

XLA's SPMD partitioner then chooses the collectives. It is the cross-check of the spmd lowering
(same numbers) and its baseline (how close meshdsl's own collectives come to XLA's choice).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from meshdsl.dims import Shape
from meshdsl.errors import LayoutError
from meshdsl.layout import Layout
from meshdsl.lowering.base import GlobalLowering
from meshdsl.mesh import Mesh
from meshdsl.tensor import Tensor


class GspmdLowering(GlobalLowering):
    """Global arrays on ``mesh`` with sharding constraints from ``layout``."""

    mesh: Mesh  # always a mesh here (the eager base lowering has none)

    def __init__(self, mesh: Mesh, layout: Layout):
        self.mesh = mesh
        self.layout = layout

    def constrain(self, t: Tensor, tensor: str = "result") -> Tensor:
        """``t`` with its array constrained to the sharding the layout gives its shape."""
        self.layout.axes(t.shape, self.mesh, tensor)
        sharding = jax.sharding.NamedSharding(self.mesh.jax_mesh, self.layout.spec(t.shape))
        return Tensor(jax.lax.with_sharding_constraint(t._data, sharding), t.shape)

    def finish(self, array, shape, axes=None, pending=(), lazy=False, tensor="output") -> Tensor:
        return self.constrain(Tensor(array, shape), tensor)

    def hold_whole(self, array: jax.Array, shape: Shape, names: Sequence[str]) -> jax.Array:
        if not any(self.layout.axes_of(n) for n in names):
            return array
        spec = self.layout.spec_of(shape.names, whole=names)
        return jax.lax.with_sharding_constraint(array, jax.sharding.NamedSharding(self.mesh.jax_mesh, spec))

    def attention_strategy(self, memory: str) -> str:
        """``all_gather`` (XLA partitions the attention itself); LayoutError for a strategy that needs
        meshdsl's own collectives, which only the spmd backend emits."""
        strategy = self.layout.attention_strategy(self.layout.axes_of(memory))
        if strategy != "all_gather":
            raise LayoutError(
                f"attention = {strategy!r} over mesh axes {self.layout.axes_of(memory)} needs the spmd backend "
                "(meshdsl's collectives); the gspmd backend leaves attention to XLA's partitioner"
            )
        return strategy

    def with_layout(self, layout: Layout) -> GspmdLowering:
        return GspmdLowering(self.mesh, layout)
