"""``cross_entropy``: mean softmax cross-entropy, optionally a chunk of positions at a time.

A language model's loss over ``[batch, length, vocab]`` float32 logits holds the whole logits
tensor (and its gradient) in memory: 1 GiB per 8 × 1024 × 32768 positions, often the step's
largest buffer. With ``chunk`` set, the positions along ``dim`` are taken ``chunk`` at a time
under ``md.scan`` with rematerialisation: each step computes its chunk's logits from the inputs
(``logits_fn``, the unembedding inside), adds up its losses and drops the logits; the backward
pass recomputes them a chunk at a time. The values and gradients are those of the plain formula;
the unembedding's matmul is run once more in the backward pass (the rematerialisation's price).

``ignore_index`` (transformers' ``-100``): positions whose target is it add nothing, and the mean is
over the others (padding and prompts in fine-tuning examples).

A label outside ``[0, vocab)`` (:func:`invalid_labels`) is never a plausible loss: where the labels
are known (an eager call) it is a DataError naming the label and its position; inside a compiled
function, where values cannot raise, the loss is NaN.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from meshdsl.dims import Dim, DimLike
from meshdsl.errors import ConfigError, DataError, ShapeError
from meshdsl.ops.creation import zeros
from meshdsl.ops.elementwise import (
    add,
    cast,
    divide,
    greater_equal,
    less,
    logical_and,
    logical_or,
    maximum,
    not_equal,
    subtract,
    where,
)
from meshdsl.ops.indexing import take_along
from meshdsl.ops.reduction import logsumexp, reduce_sum
from meshdsl.ops.reshape import replace_dimensions
from meshdsl.ops.scan import scan
from meshdsl.tensor import Tensor, describe


def invalid_labels(targets: Tensor, size: int) -> Tensor:
    """Where a label names no class: outside ``[0, size)``. The one rule for a bad label, eager and
    compiled, all at once and chunked (an ignore index is exempted by the caller)."""
    return logical_or(less(targets, 0), greater_equal(targets, size))


def _check_known_labels(targets: Tensor, size: int, ignore_index: int | None) -> None:
    """A DataError naming the first label outside ``[0, size)`` (``ignore_index`` apart), where the labels
    are values (eager)."""
    if isinstance(targets._data, jax.core.Tracer):
        return
    labels = np.asarray(targets._data)
    bad = np.argwhere(((labels < 0) | (labels >= size)) & (labels != ignore_index))
    if bad.size:
        where_ = ", ".join(f"{d.name}={int(i)}" for d, i in zip(targets.shape, bad[0]))
        raise DataError(
            f"cross_entropy: label {int(labels[tuple(bad[0])])} at ({where_}) is outside [0, {size}) "
            f"({len(bad)} such label{'s' if len(bad) > 1 else ''})"
        )


def _summed(logits: Tensor, targets: Tensor, vocab: DimLike, ignore_index: int | None) -> tuple[Tensor, Tensor | None]:
    """The sum over the counted positions of ``logsumexp(logits) - logits[target]`` (float32), and their count
    (None without ``ignore_index``: every position counts); NaN where a counted label is outside the vocabulary."""
    logits = cast(logits, jnp.float32)
    invalid = invalid_labels(targets, logits.shape[vocab].size)
    if ignore_index is None:
        losses = subtract(logsumexp(logits, vocab), take_along(logits, targets, vocab))
        return reduce_sum(where(invalid, jnp.nan, losses)), None
    kept = not_equal(targets, ignore_index)
    losses = subtract(logsumexp(logits, vocab), take_along(logits, where(kept, targets, 0), vocab))
    losses = where(logical_and(kept, invalid), jnp.nan, losses)
    return reduce_sum(where(kept, losses, 0.0)), reduce_sum(cast(kept, jnp.float32))


def _ignores(targets: Tensor, ignore_index: int | None) -> int | None:
    """``ignore_index`` where ``targets`` can hold it (an unsigned dtype cannot hold ``-100``), else None."""
    if ignore_index is None or not jnp.issubdtype(targets.dtype, jnp.integer):
        return None
    info = jnp.iinfo(targets.dtype)
    return ignore_index if info.min <= ignore_index <= info.max else None


def _check_counted(targets: Tensor, ignore_index: int) -> None:
    """DataError for concrete ``targets`` that are all ``ignore_index`` (their mean would be 0 / 0)."""
    if isinstance(targets.array, jax.core.Tracer):
        return
    if not np.any(np.asarray(targets.array) != ignore_index):
        raise DataError(
            f"cross_entropy: every one of the {targets.shape.size} targets {targets.shape} is ignore_index "
            f"{ignore_index}: no position is left to average the loss over"
        )


def cross_entropy(
    x: Tensor,
    targets: Tensor,
    logits_fn: Callable[[Tensor], Tensor],
    vocab: DimLike,
    dim: DimLike,
    chunk: int | None = None,
    *,
    ignore_index: int | None = None,
) -> Tensor:
    """Mean over ``targets``' positions of ``-log softmax(logits_fn(x))[target]`` over ``vocab``.

    ``logits_fn`` maps inputs (``x`` or a chunk of it along ``dim``) to logits with ``vocab``
    (computed in float32). ``chunk`` (positions along ``dim`` per step; None, or ``dim``'s size or
    more: all at once) bounds the logits held at once to ``chunk`` positions; it must divide
    ``dim``'s size. ``targets`` has ``x``'s dims without the last ones that ``logits_fn`` consumes:
    the logits' dims without ``vocab`` (a ShapeError otherwise). A label outside ``[0, vocab)``:
    see the module docstring. ``ignore_index``: targets equal to it are left out of the sum and the
    count. Concrete targets that are all ignored are a DataError; traced ones (inside a step) give 0,
    not NaN, so the data loaders reject such batches before the step (:mod:`meshdsl.train.examples`).
    """
    if not callable(logits_fn):
        raise ConfigError(f"cross_entropy: logits_fn must map inputs to logits (a function), got {logits_fn!r}")
    if not isinstance(targets, Tensor) or not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ShapeError(f"cross_entropy: targets must be an md tensor of integer labels, got {describe(targets)}")
    ignore = _ignores(targets, ignore_index)
    if ignore is not None:
        _check_counted(targets, ignore)
    d = x.shape[dim]
    if chunk is None or chunk >= d.size:
        logits = logits_fn(x)
        _check_targets(logits, targets, vocab)
        _check_known_labels(targets, logits.shape[vocab].size, ignore)
        total, count = _summed(logits, targets, vocab, ignore)
        return _mean(total, count, targets)
    if chunk < 1 or d.size % chunk:
        raise ConfigError(
            f"cross_entropy: chunk={chunk} must be a positive divisor of {d.name}={d.size}", op="cross_entropy"
        )
    if d.name not in targets.shape or targets.shape[d.name] != d:
        raise ShapeError(
            f"cross_entropy: targets {targets.shape} do not have the chunked dim {d} of x {x.shape}", op="cross_entropy"
        )
    chunks, piece = Dim(f"{d.name}_chunks", d.size // chunk), Dim(d.name, chunk)
    pieces = (replace_dimensions(x, d.name, [chunks, piece]), replace_dimensions(targets, d.name, [chunks, piece]))
    classes: list[int] = []

    def step(carry: tuple[Tensor, Tensor], part: tuple[Tensor, Tensor]) -> tuple[tuple[Tensor, Tensor], None]:
        logits = logits_fn(part[0])
        _check_targets(logits, part[1], vocab)
        classes.append(logits.shape[vocab].size)
        total, count = _summed(logits, part[1], vocab, ignore)
        return (add(carry[0], total), carry[1] if count is None else add(carry[1], count)), None

    start = (zeros([], jnp.float32), zeros([], jnp.float32))
    (total, count), _ = scan(step, start, pieces, chunks, remat=True)
    _check_known_labels(targets, classes[0], ignore)
    return _mean(total, None if ignore is None else count, targets)


def _mean(total: Tensor, count: Tensor | None, targets: Tensor) -> Tensor:
    """``total`` over the counted positions (all of ``targets``' without an ignore index; at least 1)."""
    return divide(total, targets.shape.size if count is None else maximum(count, 1.0))


def _check_targets(logits: Tensor, targets: Tensor, vocab: DimLike) -> None:
    """``targets`` have the dims of ``logits`` without ``vocab`` (a ShapeError naming both)."""
    if not isinstance(logits, Tensor):
        raise ConfigError(f"cross_entropy: logits_fn returned {describe(logits)}, not an md tensor of logits")
    v = logits.shape[vocab]
    want = logits.shape.without([v.name])
    if dict(zip(targets.shape.names, targets.shape.sizes)) != dict(zip(want.names, want.sizes)):
        raise ShapeError(
            f"cross_entropy: targets {targets.shape} do not match the logits {logits.shape} without {v.name}: {want}"
        )
