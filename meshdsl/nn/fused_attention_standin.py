"""A stand-in for cuDNN's fused attention, for tracing a step for a GPU on a host without one.

The planner (``meshdsl explain --profile h200`` on a laptop) traces a step without compiling or
running it, and must see the program a GPU runs: cuDNN's fused attention, which keeps no
``length x memory`` buffer. JAX refuses to trace that kernel where cuDNN is absent, so while a
step is traced for a GPU platform (:func:`meshdsl.nn.attention_impl.traced_for`) on another
host, attention binds two primitives of the same names and shapes as JAX's own
(``jax._src.cudnn.fused_attention_stablehlo``): the forward returns the output and the softmax
statistics (``[B, N, T]`` float32, its residual), the backward the three gradients. They have
shapes only, no lowering: such a program is priced, never compiled.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive

FORWARD, BACKWARD = "dot_product_attention_fwd_wrapper", "dot_product_attention_bwd_wrapper"
BTNH = 0
"""The layout parameter of the primitives: queries ``[B, T, N, H]``, as ``jax.nn.dot_product_attention`` takes them."""


def _forward_shapes(q: Any, k: Any, v: Any, **params: Any) -> tuple[Any, Any]:
    b, t, n, _ = q.shape
    return q.update(shape=q.shape, dtype=q.dtype), q.update(shape=(b, n, t), dtype=jnp.dtype(jnp.float32))


def _backward_shapes(q: Any, k: Any, v: Any, out: Any, stats: Any, grad: Any, **params: Any) -> tuple[Any, Any, Any]:
    return q.update(shape=q.shape), k.update(shape=k.shape), v.update(shape=v.shape)


forward_p = Primitive(FORWARD)
forward_p.multiple_results = True
forward_p.def_abstract_eval(_forward_shapes)
backward_p = Primitive(BACKWARD)
backward_p.multiple_results = True
backward_p.def_abstract_eval(_backward_shapes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def fused_attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float, causal: bool) -> jax.Array:
    """Attention of ``[B, T, N, H]`` queries to ``[B, S, N', H]`` keys and values, as cuDNN's kernel
    traces (see the module docstring): shapes only."""
    return _bind(q, k, v, scale, causal)[0]


def _params(scale: float, causal: bool) -> dict[str, Any]:
    return {"scale": scale, "mask_type": "CAUSAL" if causal else "NO_MASK", "layout": BTNH}


def _bind(q: jax.Array, k: jax.Array, v: jax.Array, scale: float, causal: bool) -> tuple[jax.Array, jax.Array]:
    out, stats = forward_p.bind(q, k, v, **_params(scale, causal))
    return out, stats


def _fwd(q: jax.Array, k: jax.Array, v: jax.Array, scale: float, causal: bool) -> tuple[jax.Array, tuple]:
    out, stats = _bind(q, k, v, scale, causal)
    return out, (q, k, v, out, stats)


def _bwd(scale: float, causal: bool, residuals: tuple, grad: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    dq, dk, dv = backward_p.bind(*residuals, grad, **_params(scale, causal))
    return dq, dk, dv


fused_attention.defvjp(_fwd, _bwd)
