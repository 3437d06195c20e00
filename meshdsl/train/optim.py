"""Optimizers that give the same update under every layout.

Element-wise transformations are optax's, applied leaf by leaf to the local shards (an
element-wise update is right whatever the split). Anything that takes a statistic over a dim is
written in meshdsl ops over the *named* dim, so it stays right when that dim is split:
global-norm clipping (``reduce_sum`` over every dim, a ``psum`` when split) and Adafactor's
factored second moments (means over named dims) and update clipping.

An optimizer has ``init(params) -> state`` and ``update(grads, state, params, step) ->
(params, state)``; ``step`` counts from 0.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import optax

import meshdsl as md
from meshdsl.tensor import is_tensor
from meshdsl.errors import ConfigError
from meshdsl.dims import Dim

Params = Any


def _tensors(tree: Any) -> list[md.Tensor]:
    return [x for x in jax.tree_util.tree_leaves(tree, is_leaf=is_tensor) if isinstance(x, md.Tensor)]


def global_norm(tree: Any) -> md.Tensor:
    """sqrt of the sum of squares of every entry of every tensor in ``tree``.

    Tensors split alike leave their squared sums pending over the same axes; adding those first
    costs one all-reduce per split pattern rather than one per tensor.
    """
    groups: dict[tuple[str, ...], md.Tensor] = {}
    for t in _tensors(tree):
        s = md.reduce_sum(md.square(md.cast(t, jnp.float32)))
        groups[s.pending] = groups[s.pending] + s if s.pending in groups else s
    total = None
    for s in groups.values():
        total = s if total is None else total + s
    return md.sqrt(total)


def clip_by_global_norm(tree: Any, max_norm: float) -> Any:
    """``tree`` scaled so its global norm is at most ``max_norm``."""
    scale = md.minimum(1.0, max_norm / md.maximum(global_norm(tree), 1e-12))
    return jax.tree_util.tree_map(lambda t: md.cast(t * scale, t.dtype) if is_tensor(t) else t, tree, is_leaf=is_tensor)


class Optimizer(Protocol):
    def init(self, params: Params) -> Any: ...

    def update(self, grads: Params, state: Any, params: Params, step: jax.Array) -> tuple[Params, Any]: ...


@dataclasses.dataclass(frozen=True)
class OptaxOptimizer:
    """An element-wise optax transformation, after optional global-norm clipping."""

    transform: optax.GradientTransformation
    clip_norm: float | None = None

    def init(self, params: Params) -> Any:
        return self.transform.init(params)

    def update(self, grads: Params, state: Any, params: Params, step: jax.Array) -> tuple[Params, Any]:
        if self.clip_norm is not None:
            grads = clip_by_global_norm(grads, self.clip_norm)
        updates, state = self.transform.update(grads, state, params)
        return optax.apply_updates(params, updates), state


def sgd(learning_rate: float = 0.1, momentum: float | None = None, clip_norm: float | None = None) -> OptaxOptimizer:
    """Stochastic gradient descent (optax.sgd)."""
    return OptaxOptimizer(optax.sgd(learning_rate, momentum), clip_norm)


def adamw(
    learning_rate: float = 1e-3, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
    weight_decay: float = 1e-4, clip_norm: float | None = 1.0,
) -> OptaxOptimizer:
    """AdamW (optax.adamw), with global-norm clipping by default."""
    return OptaxOptimizer(optax.adamw(learning_rate, b1, b2, eps, weight_decay=weight_decay), clip_norm)


def _rms(t: md.Tensor) -> md.Tensor:
    return md.sqrt(md.reduce_mean(md.square(t)))


@dataclasses.dataclass(frozen=True)
class Adafactor:
    """Adafactor with Mesh-TensorFlow's defaults (Shazeer & Stern, 2018).

    Second moments of a tensor whose two largest dims have at least ``min_dim_size_to_factor``
    entries are factored into a row and a column statistic over those named dims; the step is
    ``min(1e-2, 1/sqrt(t))`` times the parameter's RMS (relative step size); updates are clipped
    to RMS ``clipping_threshold``; decay ``1 - t^-0.8``; no momentum.
    """

    learning_rate: float | None = None
    decay_rate_pow: float = 0.8
    epsilon1: float = 1e-30
    epsilon2: float = 1e-3
    clipping_threshold: float | None = 1.0
    multiply_by_parameter_scale: bool = True
    min_dim_size_to_factor: int = 128

    def factored_dims(self, shape: md.Shape) -> tuple[Dim, Dim] | None:
        """The two largest dims (Mesh-TF's rule), or None when the second is too small or rank < 2."""
        if shape.rank < 2:
            return None
        d0, d1 = sorted(shape, key=lambda d: -d.size)[:2]
        return None if d1.size < self.min_dim_size_to_factor else (d0, d1)

    def init(self, params: Params) -> Any:
        def moments(p: Any) -> Any:
            if not is_tensor(p):
                return p
            dims = self.factored_dims(p.shape)
            if dims is None:
                return {"v": md.zeros(p.shape)}
            d0, d1 = dims
            return {"vr": md.zeros(p.shape.without([d0])), "vc": md.zeros(p.shape.without([d1]))}

        return jax.tree_util.tree_map(moments, params, is_leaf=is_tensor)

    def update(self, grads: Params, state: Any, params: Params, step: jax.Array) -> tuple[Params, Any]:
        t = jnp.asarray(step, jnp.float32) + 1.0
        decay = 1.0 - t ** (-self.decay_rate_pow)
        lr = self.learning_rate if self.learning_rate is not None else jnp.minimum(1e-2, jax.lax.rsqrt(t))

        def one(p: md.Tensor, g: md.Tensor, s: dict) -> tuple[md.Tensor, dict]:
            g = md.cast(g, jnp.float32)
            g2 = md.square(g) + self.epsilon1
            dims = self.factored_dims(p.shape)
            if dims is None:
                v = s["v"] * decay + g2 * (1.0 - decay)
                x, new = g * md.rsqrt(v), {"v": v}
            else:
                d0, d1 = dims
                vr = s["vr"] * decay + md.reduce_mean(g2, d0) * (1.0 - decay)
                vc = s["vc"] * decay + md.reduce_mean(g2, d1) * (1.0 - decay)
                x = g * md.rsqrt(vr / md.reduce_mean(vr, d1)) * md.rsqrt(vc)
                new = {"vr": vr, "vc": vc}
            if self.clipping_threshold is not None:
                x = x / md.maximum(1.0, _rms(x) / self.clipping_threshold)
            scale = md.maximum(_rms(p), self.epsilon2) * lr if self.multiply_by_parameter_scale else lr
            return md.cast(p - x * scale, p.dtype), new

        flat_p, treedef = jax.tree_util.tree_flatten(params, is_leaf=is_tensor)
        flat_g = treedef.flatten_up_to(grads)
        flat_s = treedef.flatten_up_to(state)
        out = [one(p, g, s) if is_tensor(p) else (p, s) for p, g, s in zip(flat_p, flat_g, flat_s)]
        return treedef.unflatten([o[0] for o in out]), treedef.unflatten([o[1] for o in out])


def make(name: str, **kwargs: Any) -> Optimizer:
    """An optimizer by name: ``sgd``, ``adamw`` or ``adafactor``."""
    makers = {"sgd": sgd, "adamw": adamw, "adafactor": Adafactor}
    if name not in makers:
        raise ConfigError(f"unknown optimizer {name!r}; choose one of {', '.join(makers)}")
    return makers[name](**kwargs)
