"""The next token of each row from the global logits ``[batch, vocab]``: greedy, or sampled with temperature,
top-k and top-p.

The draw runs on the whole logits array of every row (outside the shards: ``md.generate`` takes
the step's logits as the global array), with one key per step folded from the user's key, so one
key gives the same tokens under every layout.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: ``temperature`` 0 is greedy (argmax, ties to the lowest id);
    above 0 the logits are divided by it, cut to the ``top_k`` largest and to the smallest set whose
    probability reaches ``top_p`` (the most likely token always kept), then drawn from."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filtered(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """``logits / temperature`` with the tokens top-k and top-p remove set to -inf (float32)."""
    x = logits.astype(jnp.float32) / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, sampling.top_k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if sampling.top_p is not None and sampling.top_p < 1.0:
        ordered = jnp.sort(x, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens strictly more likely
        kept = jnp.where(before < sampling.top_p, ordered, jnp.inf)
        x = jnp.where(x < jnp.min(kept, axis=-1, keepdims=True), -jnp.inf, x)
    return x


def choose(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """The next token (int32) of each row of ``logits[batch, vocab]``; ``key`` is this step's."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filtered(logits, sampling), axis=-1).astype(jnp.int32)
