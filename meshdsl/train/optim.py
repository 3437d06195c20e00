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
import inspect
import math
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import optax

import meshdsl as md
from meshdsl.dims import Dim
from meshdsl.errors import ConfigError
from meshdsl.tensor import is_tensor

Params = Any
LearningRate = float | Callable[[Any], Any]
"""A learning rate: a number, or a function of the step (counted from 0), as optax takes it."""
SCHEDULES = ("constant", "cosine", "linear", "wsd")
WSD_DECAY_FRACTION = 0.2
"""``wsd`` decays over this fraction of the steps after warmup (at least one step), at the end."""


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
    sums = list(groups.values())
    if not sums:  # no tensors: norm 0, as optax.tree.norm
        return md.zeros([], jnp.float32)
    total = sums[0]
    for s in sums[1:]:
        total = total + s
    return md.sqrt(total)


def clip_by_global_norm(tree: Any, max_norm: float) -> Any:
    """``tree`` scaled so its global norm is at most ``max_norm``."""
    scale = md.minimum(1.0, max_norm / md.maximum(global_norm(tree), 1e-12))
    return jax.tree_util.tree_map(lambda t: md.cast(t * scale, t.dtype) if is_tensor(t) else t, tree, is_leaf=is_tensor)


def schedule(kind: str, steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.0) -> Callable[[Any], Any]:
    """The learning-rate multiplier of step ``count`` (from 0): an optax schedule from 0 to 1 and back
    to ``min_lr_ratio``.

    Every kind first rises linearly from 0 to 1 over ``warmup_steps`` (step 0 has multiplier 0, as
    optax's warmup schedules), then: ``constant`` stays at 1; ``cosine`` follows a half cosine to
    ``min_lr_ratio`` at ``steps``; ``linear`` falls linearly to it; ``wsd`` (warmup, stable, decay)
    stays at 1 and falls linearly to it over the last :data:`WSD_DECAY_FRACTION` of the steps after
    warmup. ConfigError (naming the flag) for an unknown kind, a warmup not in ``[0, steps)``, or a
    ratio outside ``[0, 1]``.
    """
    if kind not in SCHEDULES:
        raise ConfigError(f"--lr-schedule {kind!r}: choose one of {', '.join(SCHEDULES)}")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or not 0 <= warmup_steps < steps:
        raise ConfigError(f"--warmup-steps {warmup_steps}: warm up over 0 to {steps - 1} steps (the run has {steps})")
    if not (isinstance(min_lr_ratio, (int, float)) and math.isfinite(min_lr_ratio) and 0 <= min_lr_ratio <= 1):
        raise ConfigError(
            f"--min-lr-ratio {min_lr_ratio}: the final learning rate is a fraction of the peak, from 0 to 1"
        )
    w, end = warmup_steps, float(min_lr_ratio)
    if kind == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, 1.0, w, steps, end)
    rise = optax.linear_schedule(0.0, 1.0, w)
    if kind == "constant":
        return optax.join_schedules([rise, optax.constant_schedule(1.0)], [w])
    if kind == "linear":
        return optax.join_schedules([rise, optax.linear_schedule(1.0, end, steps - w)], [w])
    decay = max(1, round(WSD_DECAY_FRACTION * (steps - w)))
    stable = steps - decay
    parts = [rise, optax.constant_schedule(1.0), optax.linear_schedule(1.0, end, decay)]
    return optax.join_schedules(parts, [w, stable])


def scaled(learning_rate: float, multiplier: Callable[[Any], Any] | None) -> LearningRate:
    """``learning_rate`` times ``multiplier(step)`` (a :func:`schedule`); ``learning_rate`` itself without one."""
    return learning_rate if multiplier is None else (lambda count: learning_rate * multiplier(count))


class Optimizer(Protocol):
    def init(self, params: Params) -> Any: ...

    def update(self, grads: Params, state: Any, params: Params, step: jax.Array) -> tuple[Params, Any]: ...

    def learning_rate_at(self, step: int) -> float:
        """The learning rate the update of step ``step`` (from 0) uses."""
        ...


@dataclasses.dataclass(frozen=True)
class OptaxOptimizer:
    """An element-wise optax transformation, after optional global-norm clipping."""

    transform: optax.GradientTransformation
    clip_norm: float | None = None
    learning_rate: LearningRate | None = None
    """What ``transform`` was built with (for :meth:`learning_rate_at`); optax counts its steps in its state."""

    def learning_rate_at(self, step: int) -> float:
        lr = self.learning_rate
        return float(lr(step)) if callable(lr) else float("nan") if lr is None else float(lr)

    def init(self, params: Params) -> Any:
        return self.transform.init(params)

    def update(self, grads: Params, state: Any, params: Params, step: jax.Array) -> tuple[Params, Any]:
        if self.clip_norm is not None:
            grads = clip_by_global_norm(grads, self.clip_norm)
        updates, state = self.transform.update(grads, state, params)
        return optax.apply_updates(params, updates), state


def sgd(
    learning_rate: LearningRate = 0.1, momentum: float | None = None, clip_norm: float | None = None
) -> OptaxOptimizer:
    """Stochastic gradient descent (optax.sgd); ``learning_rate`` a number or a function of the step."""
    return OptaxOptimizer(optax.sgd(learning_rate, momentum), clip_norm, learning_rate)


def adamw(
    learning_rate: LearningRate = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    clip_norm: float | None = 1.0,
) -> OptaxOptimizer:
    """AdamW (optax.adamw), with global-norm clipping by default; ``learning_rate`` a number or a
    function of the step."""
    return OptaxOptimizer(optax.adamw(learning_rate, b1, b2, eps, weight_decay=weight_decay), clip_norm, learning_rate)


def _rms(t: md.Tensor) -> md.Tensor:
    return md.sqrt(md.reduce_mean(md.square(t)))


@dataclasses.dataclass(frozen=True)
class Adafactor:
    """Adafactor with Mesh-TensorFlow's defaults (Shazeer & Stern, 2018).

    Second moments of a tensor whose two largest dims have at least ``min_dim_size_to_factor``
    entries are factored into a row and a column statistic over those named dims; the step is
    ``min(1e-2, 1/sqrt(t))`` times the parameter's RMS (relative step size); updates are clipped
    to RMS ``clipping_threshold``; decay ``1 - t^-0.8``; no momentum. ``lr_scale``: a multiplier of
    the step (a :func:`schedule`) applied to either learning rate.
    """

    learning_rate: float | None = None
    decay_rate_pow: float = 0.8
    epsilon1: float = 1e-30
    epsilon2: float = 1e-3
    clipping_threshold: float | None = 1.0
    multiply_by_parameter_scale: bool = True
    min_dim_size_to_factor: int = 128
    lr_scale: Callable[[Any], Any] | None = None

    def _learning_rate(self, step: Any) -> Any:
        t = jnp.asarray(step, jnp.float32) + 1.0
        lr = self.learning_rate if self.learning_rate is not None else jnp.minimum(1e-2, jax.lax.rsqrt(t))
        return lr if self.lr_scale is None else lr * self.lr_scale(step)

    def learning_rate_at(self, step: int) -> float:
        return float(self._learning_rate(step))

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
        lr = self._learning_rate(step)

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

        treedef: Any  # jaxlib ships no stub for its PyTreeDef
        flat_p, treedef = jax.tree_util.tree_flatten(params, is_leaf=is_tensor)
        flat_g = treedef.flatten_up_to(grads)
        flat_s = treedef.flatten_up_to(state)
        out = [one(p, g, s) if is_tensor(p) else (p, s) for p, g, s in zip(flat_p, flat_g, flat_s)]
        return treedef.unflatten([o[0] for o in out]), treedef.unflatten([o[1] for o in out])


def make(name: str, multiplier: Callable[[Any], Any] | None = None, **kwargs: Any) -> Optimizer:
    """An optimizer by name: ``sgd``, ``adamw`` or ``adafactor``; ``multiplier``: a :func:`schedule`
    its learning rate (given in ``kwargs`` or the optimizer's default) is multiplied by."""
    makers: dict[str, Callable[..., Optimizer]] = {"sgd": sgd, "adamw": adamw, "adafactor": Adafactor}
    if name not in makers:
        raise ConfigError(f"unknown optimizer {name!r}; choose one of {', '.join(makers)}")
    if multiplier is None:
        return makers[name](**kwargs)
    if name == "adafactor":
        return Adafactor(**kwargs, lr_scale=multiplier)
    default = inspect.signature(makers[name]).parameters["learning_rate"].default
    return makers[name](**{**kwargs, "learning_rate": scaled(kwargs.get("learning_rate", default), multiplier)})
