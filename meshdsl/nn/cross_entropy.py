"""``cross_entropy``: mean softmax cross-entropy, optionally a chunk of positions at a time.

A language model's loss over ``[batch, length, vocab]`` float32 logits holds the whole logits
tensor (and its gradient) in memory: 1 GiB per 8 × 1024 × 32768 positions, often the step's
largest buffer. With ``chunk`` set, the positions along ``dim`` are taken ``chunk`` at a time
under ``md.scan`` with rematerialisation: each step computes its chunk's logits from the inputs
(``logits_fn``, the unembedding inside), adds up its losses and drops the logits; the backward
pass recomputes them a chunk at a time. The values and gradients are those of the plain formula;
the unembedding's matmul is run once more in the backward pass (the rematerialisation's price).
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp

from meshdsl.dims import Dim, DimLike
from meshdsl.errors import ConfigError
from meshdsl.ops.creation import zeros
from meshdsl.ops.elementwise import add, cast, divide, subtract
from meshdsl.ops.indexing import take_along
from meshdsl.ops.reduction import logsumexp, reduce_sum
from meshdsl.ops.reshape import replace_dimensions
from meshdsl.ops.scan import scan
from meshdsl.tensor import Tensor


def _summed(logits: Tensor, targets: Tensor, vocab: DimLike) -> Tensor:
    """The sum over every position of ``logsumexp(logits) - logits[target]`` (float32)."""
    logits = cast(logits, jnp.float32)
    return reduce_sum(subtract(logsumexp(logits, vocab), take_along(logits, targets, vocab)))


def cross_entropy(
    x: Tensor,
    targets: Tensor,
    logits_fn: Callable[[Tensor], Tensor],
    vocab: DimLike,
    dim: DimLike,
    chunk: int | None = None,
) -> Tensor:
    """Mean over ``targets``' positions of ``-log softmax(logits_fn(x))[target]`` over ``vocab``.

    ``logits_fn`` maps inputs (``x`` or a chunk of it along ``dim``) to logits with ``vocab``
    (computed in float32). ``chunk`` (positions along ``dim`` per step; None, or ``dim``'s size or
    more: all at once) bounds the logits held at once to ``chunk`` positions; it must divide
    ``dim``'s size. ``targets`` has ``x``'s dims without the last ones that ``logits_fn`` consumes.
    """
    d = x.shape[dim]
    if chunk is None or chunk >= d.size:
        return divide(_summed(logits_fn(x), targets, vocab), targets.shape.size)
    if chunk < 1 or d.size % chunk:
        raise ConfigError(
            f"cross_entropy: chunk={chunk} must be a positive divisor of {d.name}={d.size}", op="cross_entropy"
        )
    chunks, piece = Dim(f"{d.name}_chunks", d.size // chunk), Dim(d.name, chunk)
    pieces = (replace_dimensions(x, d.name, [chunks, piece]), replace_dimensions(targets, d.name, [chunks, piece]))

    def step(total: Tensor, part: tuple[Tensor, Tensor]) -> tuple[Tensor, None]:
        return add(total, _summed(logits_fn(part[0]), part[1], vocab)), None

    total, _ = scan(step, zeros([], jnp.float32), pieces, chunks, remat=True)
    return divide(total, targets.shape.size)
