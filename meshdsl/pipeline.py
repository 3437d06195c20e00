"""Pipeline parallelism: a model's stacked layers split into stages, run on microbatches (GPipe, 1F1B).

A layout rule ``layers: stage`` (any mesh axes) splits the stacked layer parameters, so each
device along ``stage`` holds ``layers / stages`` consecutive layers: its pipeline stage. The batch
is cut into ``microbatches`` equal microbatches (microbatch ``m`` holds rows ``b * M + m``, so a
batch split over ``data`` stays local), which flow through the stages in synchronous ticks;
activations move forward and gradients backward between neighbouring stages with ``ppermute``.

:func:`value_and_grad` is written once against the lowering. Under ``md.compile`` (spmd) the
number of stages is the size of the axes splitting ``layers``; on global arrays (eager, one
device) it is 1, and the same code is plain gradient accumulation over the microbatches: the
reference the tests compare with.

Schedules (``p`` stages, ``M`` microbatches, one tick = every stage runs its layers once):

* ``gpipe``: ``M + p - 1`` forward ticks (stage ``s`` runs microbatch ``t - s`` at tick ``t``);
  the backward pass is JAX's autodiff of that loop, which keeps every tick's activations:
  memory grows with ``M``.
* ``1f1b`` (PipeDream-flush in synchronous ticks): ``M + 2(p - 1)`` ticks; at tick ``t`` stage
  ``s`` runs the forward of microbatch ``t - s`` and the backward of microbatch
  ``t - 2(p - 1) + s``, recomputing its layers from the stage input it stored. A stage keeps at
  most ``2p - 1`` stage inputs (a ring buffer) and one microbatch's activations: memory is flat in
  ``M``.

The model's embedding (``pre``) and head and loss (``post``) run on every stage each tick and
are masked to stage 0 and the last stage: simple, and it costs their compute ``p`` times over.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from meshdsl.dims import Dim, Shape
from meshdsl.errors import ConfigError
from meshdsl.lowering.base import Lowering
from meshdsl.lowering.context import current
from meshdsl.ops.scan import scan
from meshdsl.pipeline_config import SCHEDULES, PipelineConfig  # noqa: F401  (md.pipeline.SCHEDULES)
from meshdsl.tensor import Tensor

STAGE_LAYERS = "stage_layers"
"""The dim a stage's own slice of ``layers`` takes inside the stage (it has no layout rule)."""


def check_model(model: Any) -> None:
    """ConfigError unless ``model`` exposes the pipeline parts (``pre``, ``layer``, ``post``, ``with_batch``)."""
    from meshdsl.model_loader import describe_model  # it imports the shipped models, which import meshdsl

    parts = ("pre", "layer", "post", "with_batch", "layers", "batch_dim")
    if not getattr(model, "pipelined", False) or not all(hasattr(model, p) for p in parts):
        raise ConfigError(
            f"model {describe_model(model)} cannot be pipelined: it needs pre, layer, post, "
            f"with_batch (and its loss must be post(layers(pre)))"
        )


def stages(lowering: Lowering, layers: Dim) -> tuple[tuple[str, ...], int]:
    """The mesh axes that split ``layers`` into stages under ``lowering``, and the number of stages."""
    axes = lowering.axes(Shape([layers]), "params['layers']")[0]
    return axes, lowering.group_size(axes)


def value_and_grad(model: Any, params: dict[str, Any], batch: dict[str, Tensor], config: PipelineConfig) -> tuple[jax.Array, Any]:
    """``(loss, grads)`` of ``model.loss(params, batch)``, as ``jax.value_and_grad`` gives them, pipelined.

    The loss is the mean over microbatches of ``post``'s loss (equal to the whole batch's mean
    loss, the microbatches being equal in size); grads come back laid out like ``params``.
    """
    check_model(model)
    run = _Run(model, params, batch, config, current())
    return run.gpipe() if config.schedule == "gpipe" else run.one_f_one_b()


class _Run:
    """One pipelined step: the local views of parameters and microbatches, and the two schedules."""

    def __init__(self, model: Any, params: dict[str, Any], batch: dict[str, Tensor], config: PipelineConfig, lowering: Lowering):
        self.lowering = lowering
        self.params = params
        self.m = config.microbatches
        self.stage_axes, self.p = stages(lowering, model.layers)
        self.stage = lowering.axis_index(self.stage_axes)
        self.first = self.stage == 0
        self.last = self.stage == self.p - 1
        self.remat = bool(getattr(getattr(model, "config", None), "remat", False))
        self.micro_model = model.with_batch(model.batch_dim.size // self.m) if self.m > 1 else model
        self._split_batch(batch, model.batch_dim)
        # Everything the activations vary along: gradients are summed over these axes once, at the end.
        self.ref = lowering.vary_like(jnp.zeros((), jnp.int32) + self.stage, *self.batch_arrays)
        self.zero_loss = lowering.vary_like(jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32) + self.stage)
        x = self._pre_tensor(self._rest(params), self._microbatch(0))
        self.x_shape, self.x_axes = x.shape, lowering.axes(x.shape)
        self.x_like = lowering.vary_like(jnp.zeros_like(lowering.prepare(x, self.x_axes)), self.ref)

    # ---- local views ----------------------------------------------------------------------------

    def _split_batch(self, batch: dict[str, Tensor], dim: Dim) -> None:
        """Each batch tensor's local array as ``[microbatches, ...]`` with its microbatch shape and layout."""
        leaves, self.batch_tree = jax.tree_util.tree_flatten(batch, is_leaf=lambda x: isinstance(x, Tensor))
        self.batch_arrays, self.batch_meta = [], []
        for t in leaves:
            if not isinstance(t, Tensor) or dim.name not in t.shape:
                raise ConfigError(f"pipeline: every batch tensor needs dim {dim.name!r} to cut into microbatches, got {getattr(t, 'shape', t)}")
            axes = self.lowering.axes(t.shape)
            a = self.lowering.prepare(t, axes)
            i = t.shape.index(dim.name)
            local = a.shape[i]
            if dim.size % self.m:
                raise ConfigError(f"pipeline: {self.m} microbatches do not divide the batch: {dim.name} is {dim.size}")
            if local % self.m:
                raise ConfigError(
                    f"pipeline: {self.m} microbatches do not divide the rows one device holds: {dim.name} is {dim.size}, "
                    f"split over {', '.join(axes[i])} into {local} rows per device"
                )
            a = jnp.moveaxis(a.reshape(a.shape[:i] + (local // self.m, self.m) + a.shape[i + 1 :]), i + 1, 0)
            shape = Shape(Dim(d.name, d.size // self.m) if d.name == dim.name else d for d in t.shape)
            self.batch_arrays.append(a)
            self.batch_meta.append((shape, axes))

    def _microbatch(self, index: Any) -> dict[str, Tensor]:
        """Microbatch ``index`` (clipped into range: out-of-range ticks compute on a real one and are masked)."""
        index = jnp.clip(index, 0, self.m - 1)
        leaves = [
            self.lowering.keep(lax.dynamic_index_in_dim(a, index, 0, keepdims=False), shape, axes)
            for a, (shape, axes) in zip(self.batch_arrays, self.batch_meta)
        ]
        return jax.tree_util.tree_unflatten(self.batch_tree, leaves)

    @staticmethod
    def _rest(params: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in params.items() if k != "layers"}

    def _vary(self, tree: Any) -> Any:
        """``tree``'s arrays marked varying along the activations' axes (their gradients are then summed once)."""
        return jax.tree_util.tree_map(lambda a: self.lowering.vary_like(a, self.ref), tree)

    def _stage_params(self, layers: dict[str, Tensor]) -> list[jax.Array]:
        """The local arrays of this stage's layers: ``layers`` split over the stage axes, other dims as stored."""
        out, self.layer_meta = [], []
        leaves, self.layer_tree = jax.tree_util.tree_flatten(layers, is_leaf=lambda x: isinstance(x, Tensor))
        for t in leaves:
            i = t.shape.index(self.micro_model.layers.name)
            own = self.lowering.layout_of(t)
            target = own[:i] + (self.stage_axes,) + own[i + 1 :]
            out.append(self.lowering.vary_like(self.lowering.prepare(t, target), self.ref))
            d = t.shape[i]
            shape = Shape(Dim(STAGE_LAYERS, d.size // self.p) if e.name == d.name else e for e in t.shape)
            self.layer_meta.append((shape, own[:i] + ((),) + own[i + 1 :]))
        return out

    # ---- the three parts on local arrays ---------------------------------------------------------

    def _pre_tensor(self, rest: dict[str, Any], mb: dict[str, Tensor]) -> Tensor:
        return self.micro_model.pre(rest, mb)

    def _pre(self, rest: dict[str, Any], mb: dict[str, Tensor]) -> jax.Array:
        return self.lowering.prepare(self._pre_tensor(rest, mb), self.x_axes)

    def _stage(self, w: list[jax.Array], x: jax.Array) -> jax.Array:
        """This stage's layers on the local activations ``x``."""
        layers = jax.tree_util.tree_unflatten(self.layer_tree, [self.lowering.keep(a, s, ax) for a, (s, ax) in zip(w, self.layer_meta)])
        x_t = self.lowering.keep(x, self.x_shape, self.x_axes)
        out, _ = scan(lambda c, lp: (self.micro_model.layer(c, lp), None), x_t, layers, STAGE_LAYERS, remat=self.remat)
        return self.lowering.prepare(out, self.x_axes)

    def _post(self, rest: dict[str, Any], y: jax.Array, mb: dict[str, Tensor]) -> jax.Array:
        loss = self.micro_model.post(rest, self.lowering.keep(y, self.x_shape, self.x_axes), mb)
        return self.lowering.prepare(loss, ())

    def _send(self, x: jax.Array, shift: int) -> jax.Array:
        return self.lowering.ppermute(x, self.stage_axes, shift, wrap=False)

    def _psum_stages(self, x: jax.Array) -> jax.Array:
        return lax.psum(x, self.stage_axes) if self.stage_axes else x

    def _prepared(self, params: dict[str, Any]) -> tuple[dict[str, Any], list[jax.Array]]:
        return self._vary(self._rest(params)), self._stage_params(params["layers"])

    # ---- schedules --------------------------------------------------------------------------------

    def gpipe(self) -> tuple[jax.Array, Any]:
        """All forwards, then JAX's backward of them: ``M + p - 1`` ticks each way."""

        def loss(params: dict[str, Any]) -> jax.Array:
            rest, w = self._prepared(params)

            def tick(carry: tuple, t: jax.Array) -> tuple[tuple, None]:
                received, total = carry
                x = jnp.where(self.first, self._pre(rest, self._microbatch(t)), received)
                y = self._stage(w, x)
                done = t - (self.p - 1)
                value = self._post(rest, y, self._microbatch(done))
                total = total + jnp.where(self.last & (done >= 0), value, 0.0)
                return (self._send(y, 1), total), None

            (_, total), _ = lax.scan(tick, (self.x_like, self.zero_loss), jnp.arange(self.m + self.p - 1))
            return self._psum_stages(total) / self.m

        return jax.value_and_grad(loss)(self.params)

    def one_f_one_b(self) -> tuple[jax.Array, Any]:
        """One forward and one backward per stage per tick, gradients by hand: ``M + 2(p - 1)`` ticks."""
        (rest, w), unprepare = jax.vjp(self._prepared, self.params)
        slots = 2 * self.p - 1
        m, p = self.m, self.p

        def tick(carry: tuple, t: jax.Array) -> tuple[tuple, None]:
            received, cotangent_in, stored, total, g_rest, g_w = carry
            f = t - self.stage  # forward of microbatch f
            x = jnp.where(self.first, self._pre(rest, self._microbatch(f)), received)
            stored = lax.dynamic_update_index_in_dim(stored, x, jnp.mod(f, slots), 0)
            y = self._stage(w, x)
            live_f = self.last & (f >= 0) & (f < m)
            value, post_vjp = jax.vjp(lambda r, y: self._post(r, y, self._microbatch(f)), rest, y)
            g_post, ct_y = post_vjp(self.lowering.vary_like(jnp.where(live_f, 1.0 / m, 0.0).astype(value.dtype), value))
            total = total + jnp.where(live_f, value, 0.0)
            b = t - 2 * (p - 1) + self.stage  # backward of microbatch b
            live_b = (b >= 0) & (b < m)
            ct = jnp.where(live_b, jnp.where(self.last, ct_y, cotangent_in), 0.0)
            _, stage_vjp = jax.vjp(self._stage, w, lax.dynamic_index_in_dim(stored, jnp.mod(b, slots), 0, keepdims=False))
            g_layers, g_x = stage_vjp(self.lowering.vary_like(ct.astype(y.dtype), y))
            _, pre_vjp = jax.vjp(lambda r: self._pre(r, self._microbatch(b)), rest)
            (g_pre,) = pre_vjp(jnp.where(self.first, g_x, 0.0).astype(g_x.dtype))
            g_rest = jax.tree_util.tree_map(lambda a, u, v: a + u + v, g_rest, g_post, g_pre)
            g_w = [a + u for a, u in zip(g_w, g_layers)]
            return (self._send(y, 1), self._send(g_x, -1), stored, total, g_rest, g_w), None

        def zeros(tree: Any) -> Any:
            return jax.tree_util.tree_map(lambda a: self.lowering.vary_like(jnp.zeros_like(a), a), tree)

        total = self.zero_loss
        stored = jnp.broadcast_to(self.x_like, (slots, *self.x_like.shape))
        stored = self.lowering.vary_like(stored, self.x_like)
        init = (self.x_like, self.x_like, stored, total, zeros(rest), zeros(w))
        (_, _, _, total, g_rest, g_w), _ = lax.scan(tick, init, jnp.arange(m + 2 * (p - 1)))
        (grads,) = unprepare((g_rest, g_w))
        return self._psum_stages(total) / m, grads


def ticks(schedule: str, stages: int, microbatches: int) -> int:
    """Synchronous ticks a step takes: ``M + p - 1`` (GPipe, each way) or ``M + 2(p - 1)`` (1F1B)."""
    return microbatches + (stages - 1) * (1 if schedule == "gpipe" else 2)


def bubble(stages: int, microbatches: int) -> float:
    """The theoretical bubble fraction of GPipe and 1F1B: ``(p - 1) / (M + p - 1)``."""
    return (stages - 1) / (microbatches + stages - 1)


def schedule_bubble(schedule: str, stages: int, microbatches: int) -> float:
    """The idle fraction of this module's synchronous ticks (idle slots compute on masked data)."""
    return 1 - microbatches / ticks(schedule, stages, microbatches)
