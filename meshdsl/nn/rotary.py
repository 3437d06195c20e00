"""``Rotary``: rotary position embeddings (RoPE, Su et al., 2021), built inside the program from ``md.range``."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from meshdsl.dims import Dim
from meshdsl.errors import ConfigError, ShapeError
from meshdsl.ops.concat import stack, unstack
from meshdsl.ops.elementwise import cast, check_float, cos, exp, sin
from meshdsl.ops.indexing import range as md_range
from meshdsl.ops.reshape import reshape
from meshdsl.tensor import Tensor, tensor

_INT32 = np.iinfo(np.int32)


@dataclasses.dataclass(frozen=True)
class Rotary:
    """Rotates pairs of ``depth`` entries of ``x`` by angles ``position * theta ** (-2 i / depth)``.

    Pair ``i`` (``i < depth / 2``) is ``(x[i], x[i + depth/2])`` in the rotate-half convention
    (Hugging Face's LLaMA, GPT-NeoX) and ``(x[2i], x[2i + 1])`` with ``interleaved=True`` (Meta's
    LLaMA, GPT-J). Positions are ``md.range`` of ``x``'s ``length`` dim (``0, 1, ...``; plus
    ``offset``) unless ``positions`` (integer, over some of ``x``'s dims) is given; angles and
    tables are made in float32 inside the program, and the result has ``x``'s dtype and shape.

    The pairs are taken by ``md.reshape`` of ``depth`` into ``[{depth}_pair, {depth}_half]`` (or
    the reverse): no layout rule names these, so under a split ``depth`` (``d_kv:model``) the
    reshape gathers it and the way back splits it again; any other split stays local.
    ``inverse``: the ``depth / 2`` frequencies ``theta ** (-2 i / depth)`` replaced by these (a
    scaled rope, such as Llama 3.1's; ``theta`` is then unused). No parameters.
    """

    depth: Dim
    _: dataclasses.KW_ONLY
    theta: float = 10000.0
    interleaved: bool = False
    length: str = "length"
    inverse: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.depth, Dim) or self.depth.size % 2:
            raise ShapeError(f"Rotary: depth must be an md.Dim of even size, got {self.depth!r}", op="Rotary")
        theta = self.theta
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
            raise ConfigError(f"Rotary: theta must be a finite number above 0, got {theta!r}", op="Rotary")
        if self.inverse is not None and len(self.inverse) != self.depth.size // 2:
            raise ShapeError(
                f"Rotary: {len(self.inverse)} inverse frequencies for depth {self.depth} (needs half)", op="Rotary"
            )

    def __call__(self, x: Tensor, *, positions: Tensor | None = None, offset: int = 0) -> Tensor:
        d = self.depth
        check_float("Rotary", x)
        if d.name not in x.shape or x.shape[d.name].size != d.size:
            raise ShapeError(f"Rotary: input {x.shape} needs the depth dim {d}", op="Rotary")
        if positions is None:
            if self.length not in x.shape:
                raise ShapeError(
                    f"Rotary: input {x.shape} has no length dim {self.length!r} (or pass positions=)", op="Rotary"
                )
            n = x.shape[self.length].size
            if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)):
                raise ShapeError(f"Rotary: offset must be an int, got {offset!r}", op="Rotary")
            if not (_INT32.min <= offset and offset + n - 1 <= _INT32.max):
                raise ShapeError(
                    f"Rotary: offset {offset} puts positions {offset}..{offset + n - 1} outside int32 "
                    f"[{_INT32.min}, {_INT32.max}]",
                    op="Rotary",
                )
            positions = md_range(x.shape[self.length]) + offset
        elif not jnp.issubdtype(positions.dtype, jnp.integer) or not set(positions.names) <= set(x.names):
            raise ShapeError(
                f"Rotary: positions {positions.shape} must be integers over dims of the input {x.shape}", op="Rotary"
            )
        pair, half = Dim(f"{d.name}_pair", 2), Dim(f"{d.name}_half", d.size // 2)
        if self.inverse is None:
            inverse = exp(cast(md_range(half), jnp.float32) * (-2.0 * math.log(self.theta) / d.size))
        else:
            inverse = tensor(jnp.asarray(self.inverse, jnp.float32), [half])
        angles = cast(positions, jnp.float32) * inverse
        c, s = cos(angles), sin(angles)
        grouped = [half, pair] if self.interleaved else [pair, half]
        at = x.shape.index(d.name)
        shape = [*x.shape.dims[:at], *grouped, *x.shape.dims[at + 1 :]]
        first, second = unstack(cast(reshape(x, shape), jnp.float32), pair.name)
        rotated = stack([first * c - second * s, second * c + first * s], pair.name, axis=shape.index(pair))
        return cast(reshape(rotated, x.shape), x.dtype)
