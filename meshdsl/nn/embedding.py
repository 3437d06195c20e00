"""``Embedding``: a table lookup by token id, vocab-parallel when ``vocab`` is split, and its tied unembedding."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from meshdsl import random
from meshdsl.dims import Dim
from meshdsl.errors import ShapeError
from meshdsl.nn.params import Dims, Stack, as_dims, cast_like, check_float, check_has, check_scale, check_sizes, dims_of
from meshdsl.ops.einsum import einsum
from meshdsl.ops.indexing import gather
from meshdsl.tensor import Tensor


@dataclasses.dataclass(frozen=True)
class Embedding:
    """A ``[vocab, *features]`` table; ``embedding(table, ids)`` is ``table[ids]`` (shape ``ids.shape + features``).

    The lookup is ``md.gather``: with ``vocab`` split over axes A (a vocab-parallel embedding, as
    Megatron's), each device looks up the ids that fall in its block of rows, zeros the others,
    and leaves a pending ``psum`` over A that the next op adds (or that stays pending through
    linear ops). Ids outside ``[0, vocab)`` give zeros. ``unembed`` gives the tied output logits.

    Params: the table. Init: normal with standard deviation ``init_scale`` (Mesh-TF's default 1).
    """

    vocab: Dim
    features: Dims
    _: dataclasses.KW_ONLY
    init_scale: float = 1.0

    def __post_init__(self) -> None:
        check_sizes("Embedding vocab", [self.vocab])
        check_scale("Embedding", self.init_scale)
        object.__setattr__(self, "features", as_dims(self.features, "Embedding features"))
        if self.vocab.name in {d.name for d in dims_of(self.features)}:
            raise ShapeError(f"Embedding: vocab {self.vocab} is also a feature dim", op="Embedding")

    def init(self, key: jax.Array, stack: Stack = ()) -> Tensor:
        """The table ``[*stack, vocab, *features]``."""
        return random.normal(key, [*stack, self.vocab, *dims_of(self.features)]) * self.init_scale

    def __call__(self, table: Tensor, ids: Tensor) -> Tensor:
        """The rows of ``table`` at integer ``ids``: ``ids.shape + features``. Concrete ids (outside a traced
        function) outside ``[0, vocab)`` are a ShapeError; traced ones cannot be read and give zero rows."""
        _check_ids(ids, self.vocab)
        return gather(table, ids, self.vocab.name)

    def unembed(self, table: Tensor, x: Tensor) -> Tensor:
        """Tied output logits ``x . table`` over the features: ``x``'s other dims, then ``vocab``
        (no collective when ``vocab`` is split: each device makes its block of logits)."""
        check_float("Embedding.unembed", x)
        check_has("Embedding.unembed", x, dims_of(self.features), "feature")
        names = {d.name for d in dims_of(self.features)}
        return einsum(x, cast_like(table, x), out=[d for d in x.shape if d.name not in names] + [self.vocab])


def _check_ids(ids: Tensor, vocab: Dim) -> None:
    """ShapeError for concrete ``ids`` outside ``[0, vocab)`` (a traced id cannot be read: it gives a zero row)."""
    if not isinstance(ids, Tensor) or not jnp.issubdtype(ids.dtype, jnp.integer):
        return  # md.gather names a wrong kind of ids
    if isinstance(ids.array, jax.core.Tracer):
        return
    values = np.asarray(ids.array)
    bad = values[(values < 0) | (values >= vocab.size)]
    if bad.size:
        raise ShapeError(
            f"Embedding: id {bad.flat[0]} of ids {ids.shape} is outside the vocab {vocab} "
            f"(ids are 0..{vocab.size - 1})",
            op="Embedding",
        )
