"""``md.generate``'s argument checks: each mistake one md error naming the argument and its value,
raised before anything compiles or runs."""

from __future__ import annotations

import numbers
from typing import Any

import jax
import numpy as np

from meshdsl.arguments import number
from meshdsl.decoding.sampling import Sampling
from meshdsl.errors import ConfigError, ShapeError
from meshdsl.tensor import describe


def _int(value: Any, what: str, low: int, high: int | None = None) -> int:
    """``value`` as an int in ``[low, high)`` (ConfigError otherwise)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"md.generate: {what} must be an int, got {describe(value)}")
    n = int(value)
    if n < low or (high is not None and n >= high):
        allowed = f"at least {low}" if high is None else f"in [{low}, {high})"
        raise ConfigError(f"md.generate: {what} must be {allowed}, got {n}")
    return n


def prompts(prompt_ids: Any, vocab: int) -> list[list[int]]:
    """The prompts as lists of ids: a 2-d integer array (equal lengths) or a list of non-empty id lists."""
    if isinstance(prompt_ids, (np.ndarray, jax.Array)):
        array = np.asarray(prompt_ids)
        if array.ndim != 2 or not np.issubdtype(array.dtype, np.integer) or 0 in array.shape:
            raise ShapeError(
                f"md.generate: prompt_ids must be a non-empty 2-d integer array [batch, length], got "
                f"{array.dtype} of shape {array.shape}"
            )
        rows = array.tolist()
    elif isinstance(prompt_ids, (list, tuple)) and prompt_ids:
        rows = [list(r) if isinstance(r, (list, tuple, np.ndarray)) else r for r in prompt_ids]
    else:
        raise ShapeError(
            f"md.generate: prompt_ids must be a 2-d integer array or a list of id lists, got {describe(prompt_ids)}"
        )
    for i, row in enumerate(rows):
        if not isinstance(row, list) or not row:
            raise ShapeError(f"md.generate: prompt {i} must be a non-empty list of ids, got {describe(row)}")
        for j, t in enumerate(row):
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise ShapeError(f"md.generate: prompt {i} id {j} must be an int, got {describe(t)}")
            if not 0 <= int(t) < vocab:
                raise ShapeError(f"md.generate: prompt {i} id {j} is {t}, outside the model's vocab of {vocab}")
    return [[int(t) for t in row] for row in rows]


def sampling(temperature: Any, top_k: Any, top_p: Any, key: Any, vocab: int) -> Sampling:
    """The checked sampling settings; a key is needed to sample (temperature above 0)."""
    t = number(temperature, "md.generate: temperature", at_least=0.0)
    k = None if top_k is None else _int(top_k, "top_k", 1, vocab + 1)
    p = None if top_p is None else number(top_p, "md.generate: top_p", above=0.0)
    if p is not None and p > 1.0:
        raise ConfigError(f"md.generate: top_p must be in (0, 1], got {top_p!r}")
    if t > 0 and key is None:
        raise ConfigError("md.generate: temperature > 0 samples, which needs key= (a jax.random.key or PRNGKey)")
    if t == 0 and (k is not None or p is not None):
        raise ConfigError("md.generate: top_k and top_p apply to sampling; give temperature > 0 with them")
    if key is not None and not (
        isinstance(key, jax.Array) and (jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) or key.shape == (2,))
    ):
        raise ConfigError(f"md.generate: key must be a jax.random.key or PRNGKey, got {describe(key)}")
    return Sampling(t, k, p)


def lengths(prompt_length: int, max_new_tokens: Any, positions: int) -> int:
    """``max_new_tokens`` checked; ConfigError when the longest prompt and the new tokens pass the model's positions."""
    n = _int(max_new_tokens, "max_new_tokens", 0)
    if prompt_length + n > positions:
        raise ConfigError(
            f"md.generate: the longest prompt ({prompt_length} ids) plus max_new_tokens={n} is {prompt_length + n} "
            f"positions, more than the model's {positions} (its config's length)"
        )
    return n


def eos(eos_token_id: Any, vocab: int) -> int | None:
    return None if eos_token_id is None else _int(eos_token_id, "eos_token_id", 0, vocab)
