"""Run a relayout plan on a local shard inside ``shard_map``: the collectives of :mod:`meshdsl.relayout`.

:mod:`meshdsl.relayout` decides which steps move a tensor from one split to another and what they
cost; this module only executes them (:func:`apply`), gathers several shards in one collective
(:func:`gather_together`), and gives the gradients of gathers and free slices the collectives
their costs assume (a reduce-scatter, an all-gather) instead of JAX's default transposes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from meshdsl import compression
from meshdsl.jax_compat import varying_axes
from meshdsl.relayout import Step, StepKind, narrower


def axis_index(axes: Sequence[str], axis_sizes: Mapping[str, int]) -> jax.Array | int:
    """This device's position along ``axes`` taken together, major to minor (0 for no axes)."""
    index: jax.Array | int = 0
    for a in axes:
        index = index * axis_sizes[a] + lax.axis_index(a)
    return index


def _leading(x: jax.Array, dim: int, collective: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """``collective`` (which gathers or scatters along dim 0) run along ``dim`` of ``x``.

    Along a dim other than the first, the blocks are strided in memory: XLA then copies the shard
    and the whole result to and from a transposed layout (on the CPU, two copies of the gathered
    array per step, forward and backward). Moved to the front, the collective works on contiguous
    blocks and XLA folds the two transposes into the neighbouring dots. The collective's values
    are the same (a dot reading the result may add its products in another order).
    """
    if dim == 0:
        return collective(x)
    return jnp.moveaxis(collective(jnp.moveaxis(x, dim, 0)), 0, dim)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather_summing_grads_in(x: jax.Array, axes: tuple[str, ...], dtype: Any) -> jax.Array:
    """``all_gather`` of ``x`` along dim 0 (varying); its gradient is reduce-scattered in ``dtype``."""
    return lax.all_gather(x, axes, axis=0, tiled=True, to="varying")


def _gather_fwd(x: jax.Array, axes: tuple[str, ...], dtype: Any) -> tuple[jax.Array, None]:
    return _gather_summing_grads_in(x, axes, dtype), None


def _gather_bwd(axes: tuple[str, ...], dtype: Any, _: None, ct: jax.Array) -> tuple[jax.Array]:
    if compression.scaled(dtype):
        n = math.prod(lax.axis_size(a) for a in axes)
        return (compression.psum_scatter(ct, axes, n, dtype),)
    return (lax.psum_scatter(ct.astype(dtype), axes, scatter_dimension=0, tiled=True).astype(ct.dtype),)


_gather_summing_grads_in.defvjp(_gather_fwd, _gather_bwd)


def _gather(x: jax.Array, axes: tuple[str, ...], to: str, grad_dtype: Any) -> jax.Array:
    """``x`` gathered along dim 0 over ``axes``. A varying result's gradient is one ``psum_scatter``,
    in ``grad_dtype`` when that is :func:`narrower` (an invariant result's gradient is a local slice)."""
    if to == "varying" and narrower(x.dtype, grad_dtype):
        return _gather_summing_grads_in(x, axes, jnp.dtype(grad_dtype))
    return lax.all_gather(x, axes, axis=0, tiled=True, to=to)


def _reorder_blocks(
    x: jax.Array, dim: int, given: tuple[str, ...], wanted: tuple[str, ...], axis_sizes: Mapping[str, int]
) -> jax.Array:
    """``x`` with the blocks of ``dim`` (one per device along ``given``, numbered major to minor)
    renumbered along ``wanted``, the same axes in another order; a local transpose.

    A collective over a tuple of axes numbers its devices in the tuple's order: block ``k`` of
    the result is the one the device at position ``k`` along ``wanted`` takes.
    """
    if given == wanted:
        return x
    counts = tuple(axis_sizes[a] for a in given)
    shape = x.shape
    blocks = x.reshape(shape[:dim] + counts + (shape[dim] // math.prod(counts),) + shape[dim + 1 :])
    order = (*range(dim), *(dim + given.index(a) for a in wanted), *range(dim + len(given), blocks.ndim))
    return blocks.transpose(order).reshape(shape)


def apply(
    x: jax.Array,
    steps: Iterable[Step],
    axis_sizes: Mapping[str, int],
    varying: frozenset[str] = frozenset(),
    grad_dtype: Any = None,
) -> jax.Array:
    """Run ``steps`` on the local shard ``x`` (inside ``shard_map`` over a mesh with ``axis_sizes``).

    A gather over axes in ``varying`` (axes the consuming op's result varies over anyway) yields a
    value JAX tracks as varying, whose gradient is one ``psum_scatter`` (in ``grad_dtype`` where
    that is narrower: ZeRO's gradient reduce-scatter in bf16); other gathers yield a replicated
    (invariant) value, whose gradient is a local slice of a replicated cotangent.
    """
    for step in steps:
        if step.kind is StepKind.PSUM:
            x = lax.psum(x, step.axes)
        elif step.kind is StepKind.PSUM_SCATTER:
            scatter = functools.partial(lax.psum_scatter, axis_name=step.axes, scatter_dimension=0, tiled=True)
            x = _leading(x, step.dim, scatter)
        elif step.kind is StepKind.ALL_GATHER:
            to = "varying" if varying.issuperset(step.axes) else "invarying"
            x = _leading(x, step.dim, functools.partial(_gather, axes=step.axes, to=to, grad_dtype=grad_dtype))
        elif step.kind is StepKind.ALL_TO_ALL:
            group = step.from_axes or step.axes
            x = _reorder_blocks(x, step.dim, step.axes, group, axis_sizes)
            x = lax.all_to_all(x, group, split_axis=step.dim, concat_axis=step.from_dim, tiled=True)
        elif step.axes and not varying_axes(x) & set(step.axes):
            x = _slice_gathering_grads(x, step.axes, step.dim, tuple(axis_sizes[a] for a in step.axes))
        else:
            x = _block(x, step.axes, step.dim, tuple(axis_sizes[a] for a in step.axes))
    return x


def _block(x: jax.Array, axes: tuple[str, ...], dim: int, counts: tuple[int, ...]) -> jax.Array:
    """This device's block of ``dim`` of ``x``, numbered along ``axes`` (``counts`` devices each), major to minor."""
    chunk = x.shape[dim] // math.prod(counts)
    return lax.dynamic_slice_in_dim(x, axis_index(axes, dict(zip(axes, counts))) * chunk, chunk, axis=dim)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _slice_gathering_grads(x: jax.Array, axes: tuple[str, ...], dim: int, counts: tuple[int, ...]) -> jax.Array:
    """The free slice of a value replicated along ``axes``; its gradient is one ``all_gather``.

    Every device holds all of ``x`` and keeps one block, so the gradient of ``x`` is the blocks'
    gradients side by side: an all-gather of ``(n - 1) / n`` of ``x``'s bytes. JAX's own transpose
    of the slice pads each block's gradient with zeros to the whole of ``x`` and sums the padded
    copies (an all-reduce of ``2 (n - 1) / n`` of them): the same values for twice the bytes.

    A custom VJP, so forward-mode differentiation (``jax.jvp``, ``jax.jacfwd``) of a program that
    slices a replicated value this way is refused by JAX, as for the gathers of ``grad_reduce_dtype``;
    and it must not run inside another custom rule's tangent (JAX cannot transpose it there): the
    tangent rules of ``exact_max``, the softmax family and ``_vary_summing_grads_in`` slice nothing.
    """
    return _block(x, axes, dim, counts)


def _slice_fwd(x: jax.Array, axes: tuple[str, ...], dim: int, counts: tuple[int, ...]) -> tuple[jax.Array, None]:
    return _block(x, axes, dim, counts), None


def _slice_bwd(axes: tuple[str, ...], dim: int, counts: tuple[int, ...], _: None, ct: jax.Array) -> tuple[jax.Array]:
    return (_leading(ct, dim, lambda a: lax.all_gather(a, axes, axis=0, tiled=True, to="invarying")),)


_slice_gathering_grads.defvjp(_slice_fwd, _slice_bwd)


def gather_together(
    arrays: Sequence[jax.Array], dims: Sequence[int], axes: tuple[str, ...], n: int, to: str, grad_dtype: Any = None
) -> list[jax.Array]:
    """Each of ``arrays`` gathered along its dim in ``dims`` over mesh ``axes`` (``n`` devices), by one ``all_gather``.

    The shards are flattened (gathered dim first) into one buffer, gathered once and cut apart
    again: one collective for a layer's stored parameters instead of one per parameter (PyTorch
    FSDP's flat parameter), and the same bytes. Its gradient is one ``psum_scatter`` (``to``
    "varying"; in ``grad_dtype`` where narrower) for them all. The arrays share a dtype.
    """
    moved = [jnp.moveaxis(a, d, 0) for a, d in zip(arrays, dims)]
    flat = jnp.concatenate([m.reshape(-1) for m in moved])
    rows = _gather(flat, axes, to, grad_dtype).reshape(n, -1)
    out, start = [], 0
    for m, d in zip(moved, dims):
        whole = rows[:, start : start + m.size].reshape((n * m.shape[0], *m.shape[1:]))
        out.append(jnp.moveaxis(whole, 0, d))
        start += m.size
    return out
