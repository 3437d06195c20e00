"""The compiled training step: one program per model x layout x optimizer.

State is ``{"params", "opt", "step"}``. Parameters and optimizer state live in the layout's
parameter rules (``[params]``; the compute rules when absent): under FSDP they are stored split,
the forward pass gathers each where it is used, and the gradient comes back reduce-scattered.
The optimizer runs under the parameter rules (``md.use_layout``), so it updates shards in place.

Synthetic batches are made inside the step from ``fold_in(data_key, step)``: each device builds
only its rows, and a run resumed at step ``s`` sees the batches an uninterrupted run would.

``accumulate`` > 1 cuts each step's batch into that many microbatches, run one after another
(:mod:`meshdsl.train.accumulate`): the update is the whole batch's, the activations one microbatch's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, cast

import jax
import jax.numpy as jnp

import meshdsl as md
from meshdsl import pipeline
from meshdsl.lowering.base import GlobalLowering
from meshdsl.lowering.context import use
from meshdsl.model import protocol as model_protocol
from meshdsl.model.protocol import Model, Pipelined, Trainable
from meshdsl.model.user import describe_model
from meshdsl.pipeline import run
from meshdsl.pipeline.config import PipelineConfig
from meshdsl.train import accumulate as accumulation
from meshdsl.train import feedback
from meshdsl.train.optim import Optimizer, global_norm

TRAINER_NEEDS = ("init", "loss")
"""What a :class:`Trainer` calls always; ``batch`` only for a step given a data key instead of a batch."""


@dataclasses.dataclass
class Trainer:
    """Compiled ``init`` and ``step`` for ``model`` on ``mesh`` under ``layout``."""

    model: Trainable
    optimizer: Optimizer
    mesh: md.Mesh
    layout: md.Layout
    backend: str = "spmd"
    grad_reduce_dtype: str | None = None
    donate: bool = True
    """The step reuses its input state's buffers for the new state (halves the state's memory);
    a state passed to ``step`` cannot be used again. Pass False to keep it."""
    pipeline: PipelineConfig | None = None
    """Microbatches and schedule; None: the layout's ``[pipeline]``. The step is pipelined
    (:mod:`meshdsl.pipeline`) when the layout splits ``layers`` or microbatches exceed 1."""
    accumulate: int = 1
    """Microbatches each step's batch is cut into for gradient accumulation (1: the whole batch at once)."""
    metrics: bool = False
    """The step returns ``(state, {"loss", "grad_norm"})`` instead of ``(state, loss)``: the global norm
    of the (accumulated, unclipped) gradient beside the loss."""
    error_feedback: bool = False
    """Keep each device's rounding error of the compressed gradient sum (``grad_reduce_dtype``) in
    ``state["error_feedback"]`` and add it to the next step's gradient (:mod:`meshdsl.train.feedback`)."""

    def _batch(self, key: jax.Array) -> Any:
        """The model's batch for ``key``; ConfigError naming the model when it has no ``batch``."""
        model_protocol.check(self.model, describe_model(self.model), ("batch",))
        return cast(Model, self.model).batch(key)

    def __post_init__(self) -> None:
        model_protocol.check(self.model, describe_model(self.model), TRAINER_NEEDS)
        self.pipeline = self.pipeline or self.layout.pipeline
        self.pipelined = pipelined(self.model, self.layout, self.pipeline, self.backend)
        check_accumulate(self.accumulate, self.pipelined)
        if self.error_feedback:
            feedback.check(self.layout, self.grad_reduce_dtype, self.pipelined, self.accumulate, self.backend)
        stored = self.layout.param_layout
        self.init = md.compile(self._init, self.mesh, self.layout, self.backend, out_layouts=stored)
        self.step = md.compile(
            self._step,
            self.mesh,
            self.layout,
            self.backend,
            in_layouts=(stored, None),
            out_layouts=(stored, None),
            grad_reduce_dtype=self.grad_reduce_dtype,
            donate_argnums=(0,) if self.donate else (),
        )
        self.evaluate = md.compile(
            self._evaluate, self.mesh, self.layout, self.backend, in_layouts=(stored, None, None)
        )
        """``evaluate(state, data, index)``: the mean loss of one batch, no update. ``data`` a key (the
        batch is ``model.batch(fold_in(data, index))``) or a batch (``index`` unused)."""

    def explain(self, state: dict[str, Any], data: Any, platform: str | None = None) -> md.Report:
        """``md.explain`` of one step under the trainer's backend: every collective, forward, backward
        and optimizer (spmd: traced, priced as on ``platform``; gspmd: measured from XLA's compiled step)."""
        stored = self.layout.param_layout
        return md.explain(
            self._step,
            self.mesh,
            self.layout,
            state,
            data,
            in_layouts=(stored, None),
            out_layouts=(stored, None),
            grad_reduce_dtype=self.grad_reduce_dtype,
            platform=platform,
            backend=self.backend,
        )

    def abstract_state(self) -> dict[str, Any]:
        """The state's global shapes and dtypes (``jax.eval_shape`` of init): nothing computed, any mesh, abstract
        too."""
        with use(GlobalLowering()):
            return jax.eval_shape(self._init, jax.ShapeDtypeStruct((2,), jnp.uint32))

    def _init(self, key: jax.Array) -> dict[str, Any]:
        params = self.model.init(key)
        with md.use_layout(self.layout.param_layout):
            opt = self.optimizer.init(params)
        state = {"params": params, "opt": opt, "step": jnp.zeros((), jnp.int32)}
        if self.error_feedback:
            state["error_feedback"] = feedback.init(params, self.layout, self.mesh)
        return state

    def loss_and_grads(self, params: Any, batch: Any) -> tuple[jax.Array, Any]:
        if self.pipelined:
            assert self.pipeline is not None  # __post_init__ set it (to the layout's when not given)
            return pipeline.value_and_grad(cast(Pipelined, self.model), params, batch, self.pipeline)
        if self.accumulate > 1:
            return accumulation.value_and_grad(self.model, params, batch, self.accumulate)
        return jax.value_and_grad(lambda p: self.model.loss(p, batch).array)(params)

    def _step(self, state: dict[str, Any], data: Any) -> tuple[dict[str, Any], Any]:
        batch = self._batch(jax.random.fold_in(data, state["step"])) if _is_key(data) else data
        if self.error_feedback:
            loss, grads, errors = feedback.value_and_grad(
                self.model, state["params"], batch, state["error_feedback"], self.grad_reduce_dtype
            )
        else:
            loss, grads = self.loss_and_grads(state["params"], batch)
        with md.use_layout(self.layout.param_layout):
            params, opt = self.optimizer.update(grads, state["opt"], state["params"], state["step"])
            norm = global_norm(grads).array if self.metrics else None
        new = {"params": params, "opt": opt, "step": state["step"] + 1}
        if self.error_feedback:
            new["error_feedback"] = errors
        return (new, {"loss": loss, "grad_norm": norm}) if self.metrics else (new, loss)

    def _evaluate(self, state: dict[str, Any], data: Any, index: jax.Array) -> jax.Array:
        batch = self._batch(jax.random.fold_in(data, index)) if _is_key(data) else data
        return accumulation.evaluate(self.model, state["params"], batch, self.accumulate)


def check_accumulate(n: Any, is_pipelined: bool) -> None:
    """ConfigError unless ``n`` is a whole number of microbatches, at least 1, for a step that is not pipelined
    (a pipelined step accumulates over its own microbatches: ``--microbatches``)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise md.ConfigError(f"--accumulate {n}: cut each step's batch into 1 or more microbatches (a whole number)")
    if n > 1 and is_pipelined:
        raise md.ConfigError(
            f"--accumulate {n} with a pipelined layout: its microbatches already accumulate; "
            f"pass --microbatches {n} instead"
        )


def pipelined(model: Trainable, layout: md.Layout, config: PipelineConfig, backend: str = "spmd") -> bool:
    """Whether a step of ``model`` under ``layout`` is pipelined: the layout splits ``layers`` into
    stages, or ``config`` asks for several microbatches. ConfigError when it is and ``model`` has no
    pipeline parts (whether or not it has a ``layers`` dim) or ``backend`` is not spmd."""
    split = layout.axes_of("layers")
    if not split and config.microbatches == 1:
        return False
    m = config.microbatches
    why = f"layers split over {', '.join(split) or 'no axis'}, {m} microbatch{'es' if m != 1 else ''}"
    try:
        pipeline.check_model(model)
    except md.ConfigError as e:
        raise md.ConfigError(f"the layout pipelines ({why}), but {e}") from None
    if backend != "spmd":
        raise md.ConfigError(f"pipelining ({why}) needs the spmd backend, not {backend}")
    sizes: dict[str, int] = dict(layout.mesh_axes or {})
    if config.schedule == "interleaved" and split and all(sizes.get(a, -1) > 0 for a in split):
        stages = math.prod(sizes[a] for a in split)
        run.check_interleaved(stages, config.microbatches, config.virtual_stages, cast(Any, model).layers)
    return True


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and (
        jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) or (x.shape == (2,) and x.dtype == jnp.uint32)
    )
