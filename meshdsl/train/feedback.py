"""Error feedback for compressed gradient sums (``Trainer(error_feedback=True)``, ``--grad-error-feedback``).

Each device keeps what rounding its gradient to ``grad_reduce_dtype`` lost on the last step and
adds it to the next step's gradient before the sum, so the rounding errors do not accumulate in
the weights (1-bit SGD's and EF-SGD's error feedback). The error is per device: it is training
state, ``state["error_feedback"]``, one tensor per parameter with a leading ``batch`` dim of one
entry per device along the batch's mesh axes (split there, so each device holds its own), saved
and restored with the rest of the state.

How it reaches the sum: each parameter is marked varying along the batch axes by one custom VJP
that also takes the residual, before the model sees the parameter (so the lowering emits no
other sum over those axes for it). Its backward adds the residual to the cotangent, sums that
compressed (:func:`meshdsl.compression.psum_with_error`) and returns the new residual as the
residual's "gradient".
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax import lax

import meshdsl as md
from meshdsl import compression, jax_compat, relayout
from meshdsl.lowering.context import current
from meshdsl.lowering.spmd import SpmdLowering, _pvary
from meshdsl.model.protocol import Trainable
from meshdsl.tensor import is_tensor


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _vary_with_feedback(x: jax.Array, r: jax.Array, axes: tuple[str, ...], n: int, dtype: Any) -> jax.Array:
    """``x`` marked varying along ``axes``; its gradient plus ``r`` summed in ``dtype``, the new ``r`` as
    ``r``'s gradient."""
    return _pvary(x, axes)


def _fwd(x: jax.Array, r: jax.Array, axes: tuple[str, ...], n: int, dtype: Any) -> tuple[jax.Array, jax.Array]:
    return _pvary(x, axes), r


def _bwd(axes: tuple[str, ...], n: int, dtype: Any, r: jax.Array, ct: jax.Array) -> tuple[jax.Array, jax.Array]:
    total, error = compression.psum_with_error(ct + r.astype(ct.dtype), axes, n, dtype)
    return total, error.astype(r.dtype)


_vary_with_feedback.defvjp(_fwd, _bwd)


def check(layout: md.Layout, grad_reduce_dtype: Any, pipelined: bool, accumulate: int | None, backend: str) -> None:
    """ConfigError where error feedback cannot run: it needs a compressed sum of the spmd backend's,
    parameters stored under the compute rules, one microbatch and no pipeline."""
    why = None
    if grad_reduce_dtype is None:
        why = "there is no compressed sum: give --grad-reduce-dtype"
    elif backend != "spmd":
        why = f"it needs the spmd backend, not {backend}"
    elif layout.params is not None:
        why = "the layout stores parameters under their own [params] rules (the error is kept per batch shard)"
    elif pipelined or (accumulate or 1) > 1:
        why = "the step is pipelined or accumulates microbatches"
    if why is not None:
        raise md.ConfigError(f"--grad-error-feedback: {why}")


def _batch_dim(layout: md.Layout, mesh: md.Mesh) -> md.Dim:
    return md.Dim("batch", relayout.group_size(layout.axes_of("batch"), mesh.axis_sizes))


def init(params: Any, layout: md.Layout, mesh: md.Mesh) -> Any:
    """Zero residuals: per parameter, ``[batch (one per batch shard), *its dims]`` float32."""
    dim = _batch_dim(layout, mesh)
    return jax.tree_util.tree_map(lambda p: md.zeros([dim, *p.shape]), params, is_leaf=is_tensor)


def value_and_grad(model: Trainable, params: Any, batch: Any, residuals: Any, dtype: Any) -> tuple[jax.Array, Any, Any]:
    """``(loss, grads, new residuals)`` of ``model.loss(params, batch)``, each parameter's gradient
    summed over the batch axes in ``dtype`` with its residual added first."""
    lowering = current()
    if not isinstance(lowering, SpmdLowering):  # global arrays (md.compile's shape pass): nothing is summed
        value, grads = jax.value_and_grad(lambda p: model.loss(p, batch).array)(params)
        return value, grads, jax.tree_util.tree_map(lambda r: md.zeros(r.shape), residuals, is_leaf=is_tensor)
    axes = tuple(lowering.layout.axes_of("batch"))
    n = lowering.group_size(axes)
    flat, tree = jax.tree_util.tree_flatten(params, is_leaf=is_tensor)
    stored = jax.tree_util.tree_leaves(residuals, is_leaf=is_tensor)

    def attach(p: md.Tensor, r: jax.Array) -> md.Tensor:
        missing = tuple(a for a in axes if a not in jax_compat.varying_axes(p._data))
        if not missing or not relayout.narrower(p.dtype, dtype):
            return p
        return lowering.keep(_vary_with_feedback(p._data, r, missing, n, dtype), p.shape, lowering.split_of(p))

    def loss(ps: list[md.Tensor], rs: list[jax.Array]) -> jax.Array:
        attached = [attach(p, r) for p, r in zip(ps, rs, strict=True)]
        value = model.loss(jax.tree_util.tree_unflatten(tree, attached), batch).array
        if jax_compat.varying_axes(value) & set(axes):
            raise md.ConfigError(
                f"--grad-error-feedback: the loss still varies along {', '.join(axes)} (batch): it must be a "
                "reduction over the batch it is given, split there, as the gradient sums each device's part"
            )
        return value

    local = [lax.squeeze(r._data, (0,)) for r in stored]
    value, (grads, errors) = jax.value_and_grad(loss, argnums=(0, 1))(flat, local)
    new = [lowering.keep(e[None], r.shape, lowering.split_of(r)) for e, r in zip(errors, stored, strict=True)]
    return value, jax.tree_util.tree_unflatten(tree, grads), jax.tree_util.tree_unflatten(tree, new)
