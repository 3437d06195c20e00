"""Pipeline parallelism: a model's stacked layers split into stages, run on microbatches (GPipe, 1F1B, interleaved).

A layout rule ``layers: stage`` (any mesh axes) splits the stacked layer parameters, so each
device along ``stage`` holds ``layers / stages`` consecutive layers: its pipeline stage. The batch
is cut into ``microbatches`` equal microbatches (microbatch ``m`` holds rows ``b * M + m``, so a
batch split over ``data`` stays local), which flow through the stages in synchronous ticks;
activations move forward and gradients backward between neighbouring stages with ``ppermute``.

:func:`value_and_grad` is written once against the lowering. Under ``md.compile`` (spmd) the
number of stages is the size of the axes splitting ``layers``; on global arrays (eager, one
device) it is 1, and the same code is plain gradient accumulation over the microbatches: the
reference the tests compare with.

Schedules (``p`` stages, ``M`` microbatches; :func:`timetable` says which stage runs what when):

* ``gpipe``: ``M + p - 1`` forward ticks (stage ``s`` runs microbatch ``t - s`` at tick ``t``);
  the backward pass is JAX's autodiff of that loop, which keeps every tick's activations:
  memory grows with ``M``.
* ``1f1b`` (PipeDream-flush in synchronous ticks): at tick ``t`` stage ``s`` runs the forward of
  microbatch ``t - s`` and the backward of microbatch ``t - 2(p - 1) + s``, from the residuals its
  forward stored (recomputed only under the model's ``remat``). The first ``p - 1`` ticks hold
  forwards only, the last ``p - 1`` backwards only, and the program holds no other half: a step
  costs ``(M + p - 1)(F + B)`` like GPipe's. A stage keeps at most ``min(M, 2p - 1)``
  microbatches' residuals, in a ring of that many slots (:func:`residual_slots`) and a spare one
  that idle forwards write to.
* ``interleaved`` (Megatron-LM's, ``virtual_stages = v``): the layers cut into ``v p`` chunks,
  chunk ``k`` on stage ``k mod p``; the 1F1B code over chunks (:func:`forward_item`,
  :func:`backward_item`), ``v M + p - 1`` chunk ticks each way: bubble ``(p - 1)/(v M + p - 1)``;
  a ring of ``min(v M, (v + 1) p - 1)`` chunk-microbatches' residuals.

The tick loop is cut into segments of ticks in which the same stages are live (each a ``scan``,
or one inline tick): a segment computes a forward (or backward) only if some stage runs one, and
sends only from the stages that do. The embedding (``pre``) runs under ``lax.cond`` on the first
stage and the head and loss (``post``) on the last: the other stages skip them.

Each 1F1B tick's forward reads its input only once the previous tick's backward has added its
weight gradients (:func:`_after`). Nothing else orders them: the forwards form one chain of ticks
and the backwards another, meeting only in the residual ring, and XLA:CPU's scheduler ran the whole
forward chain ahead, holding every version of the ring between (the interleaved small transformer
split over ``model``: 54.9 MiB a device compiled without the order, 27.8 MiB with it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshdsl.dims import Dim, Shape
from meshdsl.errors import ConfigError
from meshdsl.jax_compat import varying_axes
from meshdsl.lowering.base import Lowering
from meshdsl.lowering.context import current
from meshdsl.model import protocol as model_protocol
from meshdsl.model.protocol import Pipelined
from meshdsl.model.user import describe_model
from meshdsl.ops.scan import scan
from meshdsl.pipeline.config import PipelineConfig
from meshdsl.pipeline.schedule import Segment, backward_item, forward_item, residual_slots, timetable
from meshdsl.tensor import Tensor, is_tensor

STAGE_LAYERS = "stage_layers"
"""The dim a stage's own slice of ``layers`` takes inside the stage (it has no layout rule)."""


def check_model(model: object) -> None:
    """ConfigError unless ``model`` exposes the pipeline parts (``pre``, ``layer``, ``post``, ``with_batch``)."""

    if not model_protocol.has_pipeline_parts(model):
        raise ConfigError(
            f"model {describe_model(model)} cannot be pipelined: it needs pre, layer, post, "
            f"with_batch (and its loss must be post(layers(pre)))"
        )


def stages(lowering: Lowering, layers: Dim) -> tuple[tuple[str, ...], int]:
    """The mesh axes that split ``layers`` into stages under ``lowering``, and the number of stages."""
    axes = lowering.axes(Shape([layers]), "params['layers']")[0]
    return axes, lowering.group_size(axes)


def value_and_grad(
    model: Pipelined, params: dict[str, Any], batch: dict[str, Tensor], config: PipelineConfig
) -> tuple[jax.Array, Any]:
    """``(loss, grads)`` of ``model.loss(params, batch)``, as ``jax.value_and_grad`` gives them, pipelined.

    The loss is the mean over microbatches of ``post``'s loss (equal to the whole batch's mean
    loss, the microbatches being equal in size); grads come back laid out like ``params``.
    """
    check_model(model)
    run = _Run(model, params, batch, config, current())
    return run.gpipe() if config.schedule == "gpipe" else run.one_f_one_b()  # 1f1b, interleaved


class _Run:
    """One pipelined step: the local views of parameters and microbatches, and the two schedules."""

    def __init__(
        self,
        model: Pipelined,
        params: dict[str, Any],
        batch: dict[str, Tensor],
        config: PipelineConfig,
        lowering: Lowering,
    ):
        self.lowering = lowering
        self.params = params
        self.m, self.v, self.schedule = config.microbatches, config.virtual_stages, config.schedule
        self.stage_axes, self.p = stages(lowering, model.layers)
        if self.schedule == "interleaved":
            check_interleaved(self.p, self.m, self.v, model.layers)
        self.stage = lowering.axis_index(self.stage_axes)
        self.first = self.stage == 0
        self.last = self.stage == self.p - 1
        remat = model_protocol.config_field(model, "remat", False)
        self.remat: bool | str = model_protocol.config_field(model, "remat_policy", True) if remat else False
        # A chunk of one layer is a one-trip loop, which XLA removes: its recomputation is then free to run early,
        # and XLA runs it right after the forward it repeats, holding its activations until the backward.
        self.recompute_waits = bool(self.remat) and model.layers.size == self.p * self.v
        self.micro_model = model.with_batch(model.batch_dim.size // self.m) if self.m > 1 else model
        self._split_batch(batch, model.batch_dim)
        # Everything the activations vary along: gradients are summed over these axes once, at the end.
        self.ref = lowering.vary_like(jnp.zeros((), jnp.int32) + self.stage, *self.batch_arrays)
        self.zero_loss = lowering.vary_like(jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32) + self.stage)

        def first_input() -> jax.Array:  # traced for its shape only: no stage runs it
            x = self._pre_tensor(self._rest(params), self._microbatch(0))
            self.x_shape, self.x_axes = x.shape, lowering.axes(x.shape)
            return lowering.prepare(x, self.x_axes)

        self.x_like = lowering.vary_like(lowering.zeros_traced(jax.eval_shape(first_input)), self.ref)
        # The three parts run in every segment of the timetable (tens of them for 8 stages): each is traced once
        # and its jaxpr inlined where it runs (``inline=True``: the program is what tracing each anew gives).
        self._stage = jax.jit(self._stage_layers, inline=True)
        self._pre = jax.jit(self._pre_array, inline=True)
        self._post = jax.jit(self._post_loss, inline=True)
        self._branches: dict[Any, tuple[Callable[..., Any], Callable[..., Any]]] = {}
        """The ``cond`` branches :meth:`_when` made, by function and bound ints."""

    # ---- local views ----------------------------------------------------------------------------

    def _split_batch(self, batch: dict[str, Tensor], dim: Dim) -> None:
        """Each batch tensor's local array as ``[microbatches, ...]`` with its microbatch shape and layout."""
        leaves, self.batch_tree = jax.tree_util.tree_flatten(batch, is_leaf=is_tensor)
        self.batch_arrays, self.batch_meta = [], []
        for t in leaves:
            if not isinstance(t, Tensor) or dim.name not in t.shape:
                raise ConfigError(
                    f"pipeline: every batch tensor needs dim {dim.name!r} to cut into microbatches, got "
                    f"{getattr(t, 'shape', t)}",
                    op="pipeline",
                )
            axes = self.lowering.axes(t.shape)
            a = self.lowering.prepare(t, axes)
            i = t.shape.index(dim.name)
            local = a.shape[i]
            if dim.size % self.m:
                raise ConfigError(
                    f"pipeline: {self.m} microbatches do not divide the batch: {dim.name} is {dim.size}", op="pipeline"
                )
            if local % self.m:
                raise ConfigError(
                    f"pipeline: {self.m} microbatches do not divide the rows one device holds: {dim.name} is "
                    f"{dim.size}, "
                    f"split over {', '.join(axes[i])} into {local} rows per device",
                    op="pipeline",
                )
            a = jnp.moveaxis(a.reshape(a.shape[:i] + (local // self.m, self.m) + a.shape[i + 1 :]), i + 1, 0)
            shape = Shape(Dim(d.name, d.size // self.m) if d.name == dim.name else d for d in t.shape)
            self.batch_arrays.append(a)
            self.batch_meta.append((shape, axes))

    def _microbatch(self, index: Any) -> dict[str, Tensor]:
        """Microbatch ``index`` (clipped into range: out-of-range ticks compute on a real one and are masked)."""
        index = _clipped(index, self.m - 1)
        leaves = [
            # in range (clipped): no select for a negative index to trace, here or at the ring and stage indices
            self.lowering.keep(lax.dynamic_index_in_dim(a, index, 0, False, allow_negative_indices=False), shape, axes)
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
        """The local arrays of this stage's layers: ``layers`` split over the stage axes, other dims as stored.

        Interleaved, the device at stage ``s`` holds chunks ``s, s + p, ...`` of ``v p`` equal chunks:
        the layers are gathered over the stage axes and its chunks taken (a chunk of ``layers / (v p)``
        layers per virtual stage), in order.
        """
        out, self.layer_meta, self.layer_axis = [], [], []
        leaves, self.layer_tree = jax.tree_util.tree_flatten(layers, is_leaf=is_tensor)
        for t in leaves:
            i = t.shape.index(self.micro_model.layers.name)
            own = self.lowering.split_of(t)
            d = t.shape[i]
            if self.v == 1:
                local = self.lowering.prepare(t, own[:i] + (self.stage_axes,) + own[i + 1 :])
            else:
                whole = self.lowering.prepare(t, own[:i] + ((),) + own[i + 1 :])
                chunks = whole.reshape(whole.shape[:i] + (self.v * self.p, -1) + whole.shape[i + 1 :])
                mine = jnp.take(chunks, jnp.arange(self.v) * self.p + self.stage, axis=i)
                local = mine.reshape(whole.shape[:i] + (-1,) + whole.shape[i + 1 :])
            out.append(self.lowering.vary_like(local, self.ref))
            shape = Shape(Dim(STAGE_LAYERS, d.size // (self.p * self.v)) if e.name == d.name else e for e in t.shape)
            self.layer_meta.append((shape, own[:i] + ((),) + own[i + 1 :]))
            self.layer_axis.append(i)
        return out

    def _chunk(self, w: list[jax.Array], j: Any) -> list[jax.Array]:
        """Chunk ``j`` (of ``v``) of this stage's layers: all of them when ``v = 1``."""
        if self.v == 1:
            return w
        sizes = [a.shape[i] // self.v for a, i in zip(w, self.layer_axis)]
        return [lax.dynamic_slice_in_dim(a, j * n, n, axis=i) for a, n, i in zip(w, sizes, self.layer_axis)]

    def _add_chunk(self, g_w: list[jax.Array], g: list[jax.Array], j: Any) -> list[jax.Array]:
        """``g_w`` with the gradient ``g`` of chunk ``j`` added."""
        if self.v == 1:
            return [a + u for a, u in zip(g_w, g)]
        out = []
        for a, u, i in zip(g_w, g, self.layer_axis):
            start = j * u.shape[i]
            out.append(
                lax.dynamic_update_slice_in_dim(
                    a, lax.dynamic_slice_in_dim(a, start, u.shape[i], axis=i) + u, start, axis=i
                )
            )
        return out

    # ---- the three parts on local arrays ---------------------------------------------------------

    def _pre_tensor(self, rest: dict[str, Any], mb: dict[str, Tensor]) -> Tensor:
        return self.micro_model.pre(rest, mb)

    def _pre_array(self, rest: dict[str, Any], mb: dict[str, Tensor]) -> jax.Array:
        return self.lowering.prepare(self._pre_tensor(rest, mb), self.x_axes)

    def _stage_layers(self, w: list[jax.Array], x: jax.Array) -> jax.Array:
        """This stage's layers on the local activations ``x``."""
        layers = jax.tree_util.tree_unflatten(
            self.layer_tree, [self.lowering.keep(a, s, ax) for a, (s, ax) in zip(w, self.layer_meta)]
        )
        x_t = self.lowering.keep(x, self.x_shape, self.x_axes)
        out, _ = scan(lambda c, lp: (self.micro_model.layer(c, lp), None), x_t, layers, STAGE_LAYERS, remat=self.remat)
        return self.lowering.prepare(out, self.x_axes)

    def _pre_of(self, rest: dict[str, Any], index: Any) -> jax.Array:
        """``pre`` of microbatch ``index`` (what the first stage runs)."""
        return self._pre(rest, self._microbatch(index))

    def _post_of(self, rest: dict[str, Any], y: jax.Array, index: Any) -> jax.Array:
        """The last stage's loss of microbatch ``index``."""
        return self._post(rest, y, self._microbatch(index))

    def _post_loss(self, rest: dict[str, Any], y: jax.Array, mb: dict[str, Tensor]) -> jax.Array:
        loss = self.micro_model.post(rest, self.lowering.keep(y, self.x_shape, self.x_axes), mb)
        return self.lowering.prepare(loss, ())

    def _psum_stages(self, x: jax.Array) -> jax.Array:
        return lax.psum(x, self.stage_axes) if self.stage_axes else x

    def _prepared(self, params: dict[str, Any]) -> tuple[dict[str, Any], list[jax.Array]]:
        return self._vary(self._rest(params)), self._stage_params(params["layers"])

    # ---- what runs where --------------------------------------------------------------------------

    def _when(self, pred: Any, fn: Callable[..., Any], *operands: Any) -> Any:
        """``fn(*operands)`` on the devices where ``pred`` holds, zeros typed like it elsewhere.

        A ``lax.cond``: the other devices skip ``fn``'s work. ``pred`` depends on the stage only, so
        every device of a group that ``fn``'s collectives span (they share the stage) takes the same branch.

        The branches are made once per ``fn`` (a function the run keeps, not a closure per tick) and per Python
        int among ``operands`` (bound into the branch as a constant, as a closure would: an inline tick's
        microbatch known when tracing). So JAX traces them once and every later tick's ``cond`` takes the traced
        jaxprs from JAX's cache (with closures, each tick's ``cond`` traced its branches anew: 28 ticks of an
        8-stage 1F1B step). The zeros take the types of the true branch's results, which JAX traces first (were
        the branches ever traced the other way, ``jax.eval_shape`` of ``fn``).
        """
        if isinstance(pred, (bool, np.bool_)):  # one stage (global arrays): known when tracing
            return (
                fn(*operands)
                if pred
                else jax.tree_util.tree_map(self.lowering.zeros_traced, jax.eval_shape(fn, *operands))
            )
        bound = tuple((i, v) for i, v in enumerate(operands) if isinstance(v, int))
        key = (fn, bound)
        if key not in self._branches:
            self._branches[key] = self._branches_of(fn, dict(bound), len(operands))
        return lax.cond(pred, *self._branches[key], *(v for v in operands if not isinstance(v, int)))

    def _branches_of(
        self, fn: Callable[..., Any], bound: dict[int, int], n: int
    ) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """The ``cond`` branches of :meth:`_when`: ``fn`` on the traced operands with ``bound``'s ints put back at
        their places (``n`` operands in all), and its zeros."""
        made: dict[Any, Any] = {}

        def operands(traced: tuple[Any, ...]) -> list[Any]:
            rest = iter(traced)
            return [bound[i] if i in bound else next(rest) for i in range(n)]

        def types(traced: tuple[Any, ...]) -> Any:
            leaves, tree = jax.tree_util.tree_flatten(traced)
            return tree, tuple(jax.typeof(a) for a in leaves)

        def run(*traced: Any) -> Any:
            out = fn(*operands(traced))
            made[types(traced)] = jax.tree_util.tree_map(jax.typeof, out)
            return out

        def zeros(*traced: Any) -> Any:
            like = made.get(types(traced))
            like = jax.eval_shape(fn, *operands(traced)) if like is None else like
            return jax.tree_util.tree_map(self.lowering.zeros_traced, like)

        return run, zeros

    def _of_stage(self, values: list[int]) -> Any:
        """``values[stage]`` for this device's stage: a Python int with one stage, else one index into a
        constant vector."""
        if self.p == 1 or len(set(values)) == 1:
            return values[0]
        return lax.dynamic_index_in_dim(
            np.asarray(values, np.int32), self.stage, 0, False, allow_negative_indices=False
        )

    def _on_chunk(self, flag: Any, j: Any, chunk: int) -> Any:
        """``flag`` where this stage runs chunk ``chunk`` (``j``): a Python False where ``j``, known when tracing,
        is another chunk, so a branch that no stage takes is not traced at all (a constant predicate XLA would
        fold away with its collectives, which ``md.explain`` would still count)."""
        if self.v == 1:
            return flag
        if isinstance(j, int):
            return flag if j == chunk else False
        return flag & (j == chunk)

    def _scheduled(
        self,
        item: Callable[..., tuple[Any, Any, Any]],
        t: Any,
        table: np.ndarray,
        slot_of: jax.Array,
        live: frozenset[int],
        spare: int | None = None,
    ) -> tuple[Any, Any, Any]:
        """What this stage runs at tick ``t`` (``item``: :func:`forward_item` or :func:`backward_item`): the
        microbatch, the chunk, and the ring slot of its residuals (``table``, :func:`residual_slots`, and
        ``slot_of``, the same as a traced constant), or the slot ``spare`` on a stage outside ``live`` when given.

        At an inline tick ``t`` is a Python int, so each is worked out in Python for every stage and read by
        this stage's index: the values the arithmetic on the traced stage gives, which costs tens of traced
        operations a tick (a tenth of a pipelined step's tracing at 8 stages)."""
        p, v, last = self.p, self.v, table.shape[1] - 1
        if isinstance(t, int):
            rows = [item(t, s, p, v) for s in range(p)]
            slots = [
                int(table[s, _clipped(n, last)]) if spare is None or s in live else spare
                for s, (_, _, n) in enumerate(rows)
            ]
            return self._of_stage([r[0] for r in rows]), self._of_stage([r[1] for r in rows]), self._of_stage(slots)
        mb, j, n = item(t, self.stage, p, v)
        slot = slot_of[self.stage, _clipped(n, last)]
        if spare is not None and len(live) < p:
            slot = jnp.where(self._live(live), slot, spare)
        return mb, j, slot

    def _live(self, stages: frozenset[int]) -> Any:
        """Whether this device's stage is in ``stages`` (a Python bool with one stage)."""
        if self.p == 1:
            return 0 in stages
        return jnp.asarray([s in stages for s in range(self.p)])[self.stage]

    def _send(self, x: jax.Array, shift: int, sources: frozenset[int]) -> jax.Array:
        """``x`` sent ``shift`` stages on (round the ring when interleaved) from the stages ``sources`` only."""
        if not sources:
            return jnp.zeros_like(x)
        return self.lowering.ppermute(x, self.stage_axes, shift, wrap=self.v > 1, sources=sorted(sources))

    def _input(self, rest: dict[str, Any], segment: Segment, received: jax.Array, f: Any, j: Any) -> jax.Array:
        """The input of the forward of microbatch ``f``, chunk ``j``: ``pre`` of it on the first virtual stage,
        else what arrived."""
        if 0 not in segment.forward:
            return received
        first = self._on_chunk(self.first, j, 0)
        if first is False:
            return received
        return jnp.where(first, self._when(first, self._pre_of, rest, f), received)

    def _segments(self, tick: Callable[[Segment, Any, Any], Any], carry: Any) -> Any:
        """``carry`` through every tick of the timetable: a ``scan`` per segment, one tick inline."""
        for segment in timetable(self.schedule, self.p, self.m, self.v):
            if segment.length == 1:
                carry = tick(segment, carry, segment.start)
            else:
                ts = jnp.arange(segment.start, segment.start + segment.length)

                def step(c: Any, t: jax.Array, seg: Segment = segment) -> tuple[Any, None]:
                    return tick(seg, c, t), None

                carry, _ = lax.scan(step, carry, ts)
        return carry

    # ---- schedules --------------------------------------------------------------------------------

    def gpipe(self) -> tuple[jax.Array, Any]:
        """All forwards, then JAX's backward of them: ``M + p - 1`` ticks each way."""
        stage = _recomputed_in_backward(self._stage) if self.recompute_waits else self._stage

        def loss(params: dict[str, Any]) -> jax.Array:
            rest, w = self._prepared(params)

            def tick(segment: Segment, carry: tuple, t: Any) -> tuple:
                received, total = carry
                f = t - self.stage  # forward of microbatch f
                y = stage(w, self._input(rest, segment, received, f, 0))
                if self.p - 1 in segment.forward:
                    total = total + self._when(self.last, self._post_of, rest, y, f)
                return self._send(y, 1, segment.forward_sends), total

            _, total = self._segments(tick, (self.x_like, self.zero_loss))
            return self._psum_stages(total) / self.m

        return jax.value_and_grad(loss)(self.params)

    def one_f_one_b(self) -> tuple[jax.Array, Any]:
        """1F1B and interleaved 1F1B: a forward and a backward per stage per tick, gradients by hand from
        stored residuals."""
        (rest, w), unprepare = jax.vjp(self._prepared, self.params)
        m, p, v = self.m, self.p, self.v
        table = residual_slots(p, m, v)
        slot_of = jnp.asarray(table, jnp.int32)
        slots = int(table.max()) + 1

        # Under remat, a one-layer chunk's stored residuals wait for the output gradient, so the layer is recomputed
        # in the backward, not beside the forward (interleaved over ``stage=2 model=4`` at the small preset: 12.2 ->
        # 8.6 MiB a device).
        split = _SplitVjp(self._stage, wait=self.recompute_waits)

        def _post(rest: dict[str, Any], y: jax.Array, mb: dict[str, Tensor]) -> tuple[jax.Array, Any, jax.Array]:
            """The last stage's loss of microbatch ``mb``, and its gradients for ``rest`` and ``y`` (seeded 1/M)."""
            value, post_vjp = jax.vjp(lambda r, y: self._post(r, y, mb), rest, y)
            g_post, ct_y = post_vjp(self.lowering.vary_like(jnp.full((), 1.0 / m, value.dtype), value))
            return value, g_post, ct_y

        def _pre_grad(rest: dict[str, Any], g_x: jax.Array, mb: dict[str, Tensor]) -> Any:
            """The first stage's gradient for ``rest`` through ``pre`` of microbatch ``mb``."""
            _, pre_vjp = jax.vjp(lambda r: self._pre(r, mb), rest)
            return pre_vjp(g_x)[0]

        # Each of these runs in many segments and nothing differentiates it again: traced once and called where it
        # runs (not inlined: binding a call is one equation, inlining binds every equation of the body again; XLA
        # inlines the calls, so the compiled program is the same). So are the chunk's slicing and its gradient's
        # accumulation, a dynamic slice of every weight per tick.
        forward_kept, backward = jax.jit(split.forward), jax.jit(split.backward)
        # Every tick's forward waits on anchors of the same types: one call a tick, traced once, where tracing
        # ``_after`` anew bound tens of equations for a stage's dozen weight gradients at every tick.
        wait = jax.jit(_after)
        post, pre_grad = jax.jit(_post), jax.jit(_pre_grad)

        def post_of(rest: dict[str, Any], y: jax.Array, index: Any) -> tuple[jax.Array, Any, jax.Array]:
            return post(rest, y, self._microbatch(index))

        def pre_grad_of(rest: dict[str, Any], g_x: jax.Array, index: Any) -> Any:
            return pre_grad(rest, g_x, self._microbatch(index))

        sliced, added = (jax.jit(self._chunk), jax.jit(self._add_chunk)) if v > 1 else (self._chunk, self._add_chunk)

        def chunk(w: list[jax.Array], j: Any) -> list[jax.Array]:
            """A chunk known when tracing (an inline tick's) sliced in place: through the call its index would be
            an argument, traced, and the program would depend on whether the call is inlined."""
            return self._chunk(w, j) if isinstance(j, int) else sliced(w, j)

        def add_chunk(g_w: list[jax.Array], g: list[jax.Array], j: Any) -> list[jax.Array]:
            return self._add_chunk(g_w, g, j) if isinstance(j, int) else added(g_w, g, j)

        _, stored_like = jax.eval_shape(forward_kept, chunk(w, 0), self.x_like)
        # One slot per chunk-microbatch in flight (residual_slots says which), and a spare one that idle
        # forwards write to (masking their writes instead costs XLA more temporaries than the slot).
        ring0 = [jnp.broadcast_to(self.lowering.zeros_traced(s), (slots + 1, *s.shape)) for s in stored_like]
        ring0 = [self.lowering.vary_like(r, self.lowering.zeros_traced(s)) for r, s in zip(ring0, stored_like)]

        def add(a: Any, b: Any) -> Any:
            return jax.tree_util.tree_map(lambda u, v: u + v, a, b)

        ran_backward = False  # whether a tick traced so far ran a backward

        def tick(segment: Segment, carry: tuple, t: Any) -> tuple:
            nonlocal ran_backward
            received, ct_in, ring, total, g_rest, g_w = carry
            ct_y = None
            if segment.forward:
                # forward of microbatch f through chunk j; an idle forward writes to the spare slot
                f, j, slot = self._scheduled(forward_item, t, table, slot_of, segment.forward, slots)
                x_in = self._input(rest, segment, received, f, j)
                # after the last backward; an inline tick before any backward has nothing to wait for (its anchors
                # would be the zero accumulators, constants), a loop's tick waits for the iteration before
                if ran_backward or (segment.backward and not isinstance(t, int)):
                    x_in = wait(x_in, [*g_w, ct_in])
                y, kept = forward_kept(chunk(w, j), x_in)
                ring = [
                    lax.dynamic_update_index_in_dim(
                        r, self.lowering.vary_like(a, r), slot, 0, allow_negative_indices=False
                    )
                    for r, a in zip(ring, kept, strict=True)
                ]
                last = self._on_chunk(self.last, j, v - 1)
                if p - 1 in segment.forward and last is not False:
                    value, g_post, ct_y = self._when(last, post_of, rest, y, f)
                    total, g_rest = total + value, add(g_rest, g_post)
                received = self._send(y, 1, segment.forward_sends)
            if segment.backward:
                # backward of microbatch b through chunk j
                b, j, slot = self._scheduled(backward_item, t, table, slot_of, segment.backward)
                last = self._on_chunk(self.last, j, v - 1)
                ct = ct_in if ct_y is None or last is False else jnp.where(last, ct_y, ct_in)
                ct = jnp.where(self._live(segment.backward), ct, 0.0).astype(self.x_like.dtype)
                # An idle backward reads a slot a forward wrote, with a zero cotangent: zero gradients, never NaN.
                loaded = [lax.dynamic_index_in_dim(r, slot, 0, False, allow_negative_indices=False) for r in ring]
                leaves = split.leaves(chunk(w, j), loaded)
                g_chunk, g_x = backward(leaves, self.lowering.vary_like(ct, self.x_like))
                g_w = add_chunk(g_w, g_chunk, j)
                first = self._on_chunk(self.first, j, 0)
                if 0 in segment.backward and first is not False:
                    g_rest = add(g_rest, self._when(first, pre_grad_of, rest, g_x, b))
                ct_in = self._send(g_x, -1, segment.backward_sends)
                ran_backward = True
            return received, ct_in, ring, total, g_rest, g_w

        def zeros(tree: Any) -> Any:
            return jax.tree_util.tree_map(lambda a: self.lowering.vary_like(jnp.zeros_like(a), a), tree)

        init = (self.x_like, self.x_like, ring0, self.zero_loss, zeros(rest), zeros(w))
        _, _, _, total, g_rest, g_w = self._segments(tick, init)
        (grads,) = unprepare((g_rest, g_w))
        return self._psum_stages(total) / m, grads


def _clipped(index: Any, last: int) -> Any:
    """``index`` clipped into ``[0, last]``: in Python where known when tracing (an inline tick's), else traced."""
    return min(max(index, 0), last) if isinstance(index, int) else jnp.clip(index, 0, last)


def check_interleaved(p: int, m: int, v: int, layers: Dim) -> None:
    """ConfigError unless ``p`` stages of ``v`` chunks can run ``m`` microbatches interleaved. Called
    before the step is built with the stages of the layout's mesh (``train.step.pipelined``): a trace
    without a mesh (the output shapes' ``GlobalLowering``) sees 1 stage."""
    if m % p:
        raise ConfigError(
            f"pipeline: the interleaved schedule runs microbatches in groups of the {p} stages: "
            f"{m} microbatches is not a multiple of {p}",
            op="pipeline",
        )
    if layers.size % (p * v):
        raise ConfigError(
            f"pipeline: {p} stages x {v} virtual stages do not divide {layers.name} ({layers.size}) into equal chunks",
            op="pipeline",
        )


class _SplitVjp:
    """The vjp of a stage ``fn(w, x)`` cut at its residuals, for a backward that runs apart from its forward.

    :meth:`forward` gives the output and the residuals to store: those that are not weights (a weight is at hand
    when the backward runs). :meth:`leaves` puts the stored ones and the weights back in the vjp's order, and
    :meth:`backward` applies the vjp to them. Where and which are weights, and the residuals' tree, are recorded
    when :meth:`forward` is traced. ``wait``: the stored residuals pass :func:`_after` the output gradient, so a
    layer that remat recomputes is recomputed in the backward, not beside the forward (a one-layer chunk's
    one-trip layer loop, which XLA removes)."""

    def __init__(self, fn: Callable[[list[jax.Array], jax.Array], jax.Array], wait: bool):
        self.fn, self.wait = fn, wait
        self.tree: Any = None  # jaxlib ships no stub for its PyTreeDef
        self.weight_at: list[int | None] = []
        """Per vjp residual: its index in ``w`` where it is a weight, else None (stored)."""

    def forward(self, w: list[jax.Array], x: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
        y, vjp = jax.vjp(self.fn, w, x)
        leaves: list[Any]
        leaves, self.tree = jax.tree_util.tree_flatten(vjp)
        weights = {id(a): i for i, a in enumerate(w)}
        self.weight_at = [weights.get(id(a)) for a in leaves]
        return y, [a for a, i in zip(leaves, self.weight_at) if i is None]

    def leaves(self, w: list[jax.Array], stored: list[jax.Array]) -> list[jax.Array]:
        kept = iter(stored)
        return [next(kept) if i is None else w[i] for i in self.weight_at]

    def backward(self, leaves: list[jax.Array], ct: jax.Array) -> tuple[list[jax.Array], jax.Array]:
        if self.wait:
            leaves = [_after(a, [ct]) if i is None else a for a, i in zip(leaves, self.weight_at)]
        return jax.tree_util.tree_unflatten(self.tree, leaves)(ct)


def _recomputed_in_backward(
    fn: Callable[[list[jax.Array], jax.Array], jax.Array],
) -> Callable[[list[jax.Array], jax.Array], jax.Array]:
    """``fn(w, x)`` whose backward waits for its output gradient (:class:`_SplitVjp` with ``wait``), so XLA
    recomputes a one-layer stage under remat in the backward, not beside the forward (GPipe over ``stage=4
    model=2`` at the small preset with remat: 10.4 MiB a device compiled, 14.9 MiB without it). GPipe's backward
    is JAX's transposition of the ticks, so a custom vjp is the one place to say it; its residuals are the vjp's
    own, so ``remat``'s policy keeps what it kept."""
    split = _SplitVjp(fn, wait=True)

    @jax.custom_vjp
    def waiting(w: list[jax.Array], x: jax.Array) -> jax.Array:
        return fn(w, x)

    def forward(w: list[jax.Array], x: jax.Array) -> tuple[jax.Array, tuple[list[jax.Array], list[jax.Array]]]:
        y, stored = split.forward(w, x)
        return y, (w, stored)

    def backward(res: tuple[list[jax.Array], list[jax.Array]], ct: jax.Array) -> tuple[list[jax.Array], jax.Array]:
        w, stored = res
        return split.backward(split.leaves(w, stored), ct)

    waiting.defvjp(forward, backward)
    return waiting


def _after(x: jax.Array, anchors: list[jax.Array]) -> jax.Array:
    """``x``, as a value XLA can compute only once ``anchors`` are made: a select of ``x`` on a predicate of their
    first elements that is always true but that XLA does not fold (their bits or'd ``| 1 != 0``; an
    ``optimization_barrier`` would not do: XLA:CPU removes barriers before it schedules). The same numbers, NaN or
    not: the other branch is never taken. An anchor that varies along a mesh axis ``x`` does not (a gradient of a
    weight split over ``model``, ``x`` replicated there) joins through a ``pmax`` of its bits over those axes, four
    bytes a tick: without it XLA copied every residual ring such a gradient's backward read, each tick."""
    axes = varying_axes(x)
    bits, apart = jnp.int32(1), jnp.int32(1)
    for anchor in anchors:
        first = lax.bitcast_convert_type(anchor.reshape(-1)[0].astype(jnp.float32), jnp.int32)
        if varying_axes(anchor) <= axes:
            bits = lax.bitwise_or(bits, first)
        else:
            apart = lax.bitwise_or(apart, first)
    missing = tuple(sorted(varying_axes(apart) - axes))
    if missing:  # non-negative, so the largest is not 0 either
        bits = lax.bitwise_or(bits, lax.pmax(lax.bitwise_and(apart, jnp.int32(0x7FFFFFFF)), missing))
    return jnp.where(bits != 0, x, jnp.zeros((), x.dtype))
