"""``PositionEmbedding``: a learned embedding of each position, added to the input (GPT-2's ``wpe``)."""

from __future__ import annotations

import dataclasses

import jax

from meshdsl import random
from meshdsl.dims import Dim
from meshdsl.errors import ShapeError
from meshdsl.nn.params import Dims, Stack, as_dims, cast_like, check_has, dims_of
from meshdsl.ops.concat import slice as md_slice
from meshdsl.ops.reshape import rename
from meshdsl.tensor import Tensor


@dataclasses.dataclass(frozen=True)
class PositionEmbedding:
    """A learned table ``[positions, *features]``; ``layer(table, x)`` is ``x`` plus the rows of its positions.

    ``x[*batch, length, *features]``'s position ``i`` gets row ``offset + i`` of the table (the
    first ``length`` rows, renamed to ``length``): a component-wise add, so a split ``length``
    or feature dim costs nothing when ``positions`` is the same size as ``length`` (``positions``
    and ``length`` may share a name). Params: the table, normal with standard deviation
    ``init_scale`` (GPT-2's 0.01).
    """

    positions: Dim
    features: Dims
    _: dataclasses.KW_ONLY
    length: str = "length"
    init_scale: float = 0.01

    def __post_init__(self) -> None:
        object.__setattr__(self, "features", as_dims(self.features, "PositionEmbedding features"))
        if self.positions.name in {d.name for d in dims_of(self.features)}:
            raise ShapeError(
                f"PositionEmbedding: positions {self.positions} is also a feature dim", op="PositionEmbedding"
            )

    def init(self, key: jax.Array, stack: Stack = ()) -> Tensor:
        """The table ``[*stack, positions, *features]``."""
        return random.normal(key, [*stack, self.positions, *dims_of(self.features)]) * self.init_scale

    def __call__(self, table: Tensor, x: Tensor, *, offset: int = 0) -> Tensor:
        check_has("PositionEmbedding", x, dims_of(self.features), "feature")
        if self.length not in x.shape:
            raise ShapeError(
                f"PositionEmbedding: input {x.shape} has no length dim {self.length!r}", op="PositionEmbedding"
            )
        n = x.shape[self.length].size
        if offset < 0 or offset + n > self.positions.size:
            raise ShapeError(
                f"PositionEmbedding: positions {offset}..{offset + n - 1} of {x.shape} "
                f"are outside the table's {self.positions}",
                op="PositionEmbedding",
            )
        rows = table if offset == 0 and n == self.positions.size else md_slice(table, offset, n, self.positions.name)
        if self.positions.name != self.length:
            rows = rename(rows, self.positions.name, self.length)
        return x + cast_like(rows, x)
