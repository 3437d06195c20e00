"""``md.generate``: continue prompts with a decoder under any mesh and layout, greedy or sampled.

Prompts of different lengths are left-padded to the longest (as transformers does): padding
slots are invalid in the cache's mask, and each row's positions (its rotary angles) count from
its first real token. The prefill writes every prompt's keys and values at once; each decode
step feeds one token per row and writes it at the next slot, so all rows step together. A row
that produces ``eos_token_id`` is padded with it from there on; when every row has, decoding
stops. Sampling draws on the global logits with ``fold_in(key, step)``: the same key gives the
same tokens under every layout.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from meshdsl.decoding import checks
from meshdsl.decoding.decoder import Decoder, check_model
from meshdsl.errors import ConfigError
from meshdsl.layout import Layout
from meshdsl.mesh import Mesh
from meshdsl.model.protocol import Decoding, Model

Progress = Callable[[int, int], None]
"""``progress(tokens done, tokens in all)``, called after the prefill and after each decode step."""


@dataclasses.dataclass(frozen=True)
class Generation:
    """``ids[batch, prompt + max_new_tokens]``: left-padded prompts, then the new tokens (``pad`` after a
    row's end). ``prompt_length``: the longest prompt; ``steps``: the decode steps timed (all but the
    first, which compiles on a first call) and ``decode_seconds`` theirs; ``prefill_seconds``: the
    prefill's (compile included on a first call)."""

    ids: np.ndarray
    prompt_length: int
    steps: int
    prefill_seconds: float
    decode_seconds: float


def _model_sizes(model: Model) -> tuple[int, int]:
    """The model's vocab and positions (its config's ``vocab`` and ``length``)."""
    config = getattr(model, "config", None)
    vocab, length = getattr(config, "vocab", None), getattr(config, "length", None)
    if not isinstance(vocab, int) or not isinstance(length, int):
        raise ConfigError("md.generate: the model's config needs int fields vocab and length (its positions)")
    return vocab, length


def left_padded(rows: list[list[int]], pad: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ids[batch, longest], valid[batch, longest])``: each row right-aligned after ``pad`` ids."""
    longest = max(map(len, rows))
    ids = np.full((len(rows), longest), pad, np.int32)
    valid = np.zeros((len(rows), longest), bool)
    for i, row in enumerate(rows):
        ids[i, longest - len(row) :] = row
        valid[i, longest - len(row) :] = True
    return ids, valid


def run(
    decoder: Decoder,
    params: Any,
    rows: list[list[int]],
    max_new_tokens: int,
    key: jax.Array | None = None,
    progress: Progress | None = None,
) -> Generation:
    """Continue checked prompts ``rows`` by ``max_new_tokens`` with ``decoder`` (parameters placed by
    ``decoder.place``); see the module docstring."""
    pad = 0 if decoder.eos_token_id is None else decoder.eos_token_id
    prompt, prompt_valid = left_padded(rows, pad)
    batch, length = prompt.shape
    memory = length + max_new_tokens
    if max_new_tokens == 0:
        return Generation(prompt, length, 0, 0.0, 0.0)
    valid = jnp.asarray(np.concatenate([prompt_valid, np.ones((batch, max_new_tokens), bool)], axis=1))
    own_length = prompt_valid.sum(axis=1).astype(np.int32)
    positions = np.maximum(np.cumsum(prompt_valid, axis=1) - 1, 0).astype(np.int32)
    key = jax.random.key(0) if key is None else key
    done = jnp.zeros((batch,), bool)
    cache = decoder.cache(batch, memory)
    start = time.perf_counter()
    cache, token, done = decoder.advance(
        params, cache, jnp.asarray(prompt), 0, jnp.asarray(positions), valid, jax.random.fold_in(key, 0), done
    )
    new = [token]
    token.block_until_ready()
    prefill = time.perf_counter() - start
    if progress:
        progress(1, max_new_tokens)
    start, steps = time.perf_counter(), 0
    for t in range(1, max_new_tokens):
        if decoder.eos_token_id is not None and bool(done.all()):
            break
        at = jnp.asarray(own_length + t - 1)[:, None]
        cache, token, done = decoder.advance(
            params, cache, token[:, None], length + t - 1, at, valid, jax.random.fold_in(key, t), done
        )
        new.append(token)
        if t == 1:  # the first decode step compiles: the timed steps are the ones after it
            token.block_until_ready()
            start = time.perf_counter()
        else:
            steps += 1
        if progress:
            progress(t + 1, max_new_tokens)
    out = np.asarray(jnp.stack(new, axis=1))
    decode = time.perf_counter() - start
    ids = np.full((batch, memory), pad, np.int32)
    ids[:, :length], ids[:, length : length + out.shape[1]] = prompt, out
    return Generation(ids, length, steps, prefill, decode)


def generate(
    model: Model,
    params: Any,
    prompt_ids: Any,
    *,
    max_new_tokens: int,
    mesh: Mesh,
    layout: Layout | str,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    key: jax.Array | None = None,
    eos_token_id: int | None = None,
    backend: str = "spmd",
) -> np.ndarray:
    """``ids[batch, longest prompt + max_new_tokens]`` (int32): the prompts, left-padded, then the new tokens.

    ``prompt_ids``: a 2-d integer array or a list of id lists of any lengths (left-padded with
    ``eos_token_id``, or 0 without one). ``temperature`` 0: greedy; above 0: sampled (``top_k``,
    ``top_p``; ``key`` needed). ``eos_token_id``: a row ends there and is padded with it. Every
    argument is checked first (one md error each), the prompt plus ``max_new_tokens`` against the
    model's positions included.
    """
    check_model(model)
    if not isinstance(mesh, Mesh):
        raise ConfigError(f"md.generate: mesh must be an md.Mesh, got {type(mesh).__name__}")
    vocab, positions = _model_sizes(model)
    rows = checks.prompts(prompt_ids, vocab)
    n = checks.lengths(max(map(len, rows)), max_new_tokens, positions)
    sampling = checks.sampling(temperature, top_k, top_p, key, vocab)
    eos = checks.eos(eos_token_id, vocab)
    decoder = Decoder(cast(Decoding, model), mesh, layout, backend, sampling, eos)  # Decoder checks it can
    return run(decoder, decoder.place(params), rows, n, key).ids
