"""Gradient accumulation: a step's batch cut into microbatches, run one after another under ``lax.scan``.

Any model works: the batch (a pytree of md tensors) is cut along its batch dim (the model's
``batch_dim`` where it has one, as a pipelined model does, else the dim named ``batch``), so microbatch
``m`` of ``n`` holds rows ``b * n + m`` (as :mod:`meshdsl.pipeline` cuts it): a batch split over
devices stays where it is, each device cutting its own rows. ``model.loss`` is called on each
microbatch (``model.with_batch(rows)``'s loss where the model has that method, as a pipelined
one does; else ``model.loss`` itself, which must then take the batch size from its batch) and its
gradient taken there; a ``scan`` carries the running sums, so memory holds one
microbatch's activations whatever ``n`` is.

The result is the mean over microbatches of their losses and gradients. It equals the whole
batch's loss and gradient when the loss is a mean over examples whose terms do not depend on the
batch's other examples (a statistic over the whole batch would be taken per microbatch instead)
and the microbatches are the same size, which is why ``n`` must divide the rows every device holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from meshdsl.dims import Dim, Shape
from meshdsl.errors import ConfigError, ShapeError
from meshdsl.lowering.context import current
from meshdsl.model import protocol as model_protocol
from meshdsl.model.protocol import Trainable
from meshdsl.tensor import is_tensor

BATCH = "batch"
"""The dim a batch is cut along when the model names no ``batch_dim``."""


def batch_dim_name(model: object) -> str:
    """The name of the dim ``model``'s batch is cut along: its ``batch_dim``'s, else :data:`BATCH`."""
    dim = model_protocol.batch_dim(model)
    return BATCH if dim is None else dim.name


def split(batch: Any, n: int, name: str = BATCH) -> tuple[list[jax.Array], Callable[[list[jax.Array]], Any], int]:
    """The local arrays of ``batch``'s tensors as ``[n, ...]`` stacks cut along dim ``name``, the function
    that turns one slice of each back into a microbatch (md tensors of ``1 / n`` of the rows), and the
    batch size. ConfigError when a tensor has no such dim or ``n`` does not divide the rows a device holds."""
    lowering = current()
    leaves, tree = jax.tree_util.tree_flatten(batch, is_leaf=is_tensor)
    stacks, meta = [], []
    for t in leaves:
        if not is_tensor(t) or name not in t.shape:
            raise ConfigError(
                f"--accumulate {n}: every tensor of the model's batch needs a dim {name!r} to cut, "
                f"got {getattr(t, 'shape', t)}"
                + (
                    "; a model whose batch dim has another name says which with a batch_dim attribute (an md.Dim)"
                    if name == BATCH
                    else ""
                )
            )
        axes = lowering.split_of(t)
        a = lowering.prepare(t, axes)
        i = t.shape.index(name)
        size, local = t.shape[name].size, a.shape[i]
        if size % n or local % n:
            rows = f"{local} row{'s' if local != 1 else ''}"
            where = f" ({rows} on each device: it is split over {', '.join(axes[i])})" if axes[i] else ""
            raise ConfigError(
                f"--accumulate {n} does not divide the batch of {size}{where}; equal microbatches are what make "
                f"the mean of their mean losses the whole batch's mean loss"
            )
        stacks.append(jnp.moveaxis(a.reshape(a.shape[:i] + (local // n, n) + a.shape[i + 1 :]), i + 1, 0))
        meta.append((Shape(Dim(d.name, d.size // n) if d.name == name else d for d in t.shape), axes))

    def microbatch(arrays: list[jax.Array]) -> Any:
        return jax.tree_util.tree_unflatten(tree, [lowering.keep(a, s, ax) for a, (s, ax) in zip(arrays, meta)])

    return stacks, microbatch, size


def _loss(model: Trainable, size: int, n: int) -> Callable[[Any, Any], jax.Array]:
    """The loss of a microbatch of ``size // n`` rows, as an array; a ShapeError in it as a ConfigError saying why."""
    micro = model_protocol.with_batch(model, size // n) if n > 1 else model

    def loss(params: Any, batch: Any) -> jax.Array:
        try:
            return micro.loss(params, batch).array
        except ShapeError as e:
            if n == 1:
                raise
            raise ConfigError(
                f"--accumulate {n}: the model's loss fails on a microbatch of {size // n} rows ({e}); it must take the "
                f"batch size from its batch, not from the model's config (or give the model with_batch(rows))"
            ) from None

    return loss


def value_and_grad(model: Trainable, params: Any, batch: Any, n: int) -> tuple[jax.Array, Any]:
    """``(loss, grads)`` of ``model.loss(params, batch)`` as the mean over ``n`` microbatches (see the module)."""
    stacks, microbatch, size = split(batch, n, batch_dim_name(model))
    loss = _loss(model, size, n)

    def one(xs: list[jax.Array]) -> tuple[jax.Array, Any]:
        return jax.value_and_grad(lambda p: loss(p, microbatch(xs)))(params)

    def body(carry: tuple[jax.Array, Any], xs: list[jax.Array]) -> tuple[tuple[jax.Array, Any], None]:
        value, grads = one(xs)
        return jax.tree_util.tree_map(jnp.add, carry, (value, grads)), None

    (total, grads), _ = lax.scan(body, _zeros(one, stacks), stacks)
    return total / n, jax.tree_util.tree_map(lambda g: g / n, grads)


def evaluate(model: Trainable, params: Any, batch: Any, n: int) -> jax.Array:
    """The mean of the model's loss over ``n`` microbatches of ``batch`` (no gradient)."""
    if n == 1:
        return model.loss(params, batch).array
    stacks, microbatch, size = split(batch, n, batch_dim_name(model))
    loss = _loss(model, size, n)

    def body(total: jax.Array, xs: list[jax.Array]) -> tuple[jax.Array, None]:
        return total + loss(params, microbatch(xs)), None

    total, _ = lax.scan(body, _zeros(lambda xs: loss(params, microbatch(xs)), stacks), stacks)
    return total / n


def _zeros(fn: Callable[[list[jax.Array]], Any], stacks: list[jax.Array]) -> Any:
    """Zeros shaped, typed and (under ``shard_map``) varying like ``fn``'s results on one microbatch:
    a scan's first carry."""
    return jax.tree_util.tree_map(jnp.zeros_like, jax.eval_shape(fn, [s[0] for s in stacks]))
