"""The per-device program of one training step, traced on an abstract mesh.

``jax.sharding.AbstractMesh`` has axis names and sizes but no devices; ``jax.shard_map`` over it
traces to a jaxpr with the local (per-device) shapes and every collective meshdsl emits, exactly
as ``md.explain`` sees them on real devices. So a 64-device layout is planned on a laptop, and
nothing is compiled or computed: tracing costs about the same for a tiny model and a 1B one.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

import meshdsl as md
from meshdsl.analysis.jaxpr_walk import called
from meshdsl.lowering.base import GlobalLowering
from meshdsl.lowering.context import use
from meshdsl.model.protocol import Model
from meshdsl.nn.attention_impl import traced_for
from meshdsl.planner.memory import peak_bytes
from meshdsl.planner.program import block
from meshdsl.train.step import Trainer


@dataclasses.dataclass(frozen=True)
class Batch:
    """A model's synthetic batch: its global shapes, and the peak bytes of making it on one device."""

    shapes: Any
    making_peak: int


@dataclasses.dataclass(frozen=True)
class Traced:
    """A traced training step: its jaxpr (as traced: the walker reads it as XLA compiles it), the abstract state and
    batch, the mesh."""

    jaxpr: Any
    making: Any
    """The per-device jaxpr of making the synthetic batch under the layout: the step train and bench run makes
    it from a key, and a model's batch may communicate (a shift along a split dim is a permute)."""
    state: Any
    batch: Batch
    mesh: md.Mesh
    layout: md.Layout


_KEY = jax.ShapeDtypeStruct((2,), jnp.uint32)
"""The raw key a synthetic batch is made from (``jax.random.key_data``'s shape)."""


def abstract_batch(model: Model) -> Batch:
    """The synthetic batch of ``model``, traced once on global arrays (the same under every layout)."""
    with use(GlobalLowering()):
        closed, shapes = jax.make_jaxpr(model.batch, return_shape=True)(_KEY)
    made = block(closed.jaxpr)
    return Batch(shapes, peak_bytes(made, set(made.outputs)))


def trace_step(
    model: Model,
    optimizer: Any,
    axis_sizes: Mapping[str, int],
    layout: md.Layout,
    grad_reduce_dtype: str | None = None,
    batch: Batch | None = None,
    platform: str | None = None,
    results: Any = None,
    state: Any = None,
) -> Traced:
    """Trace one step of ``model`` under ``layout`` on a mesh of ``axis_sizes``; LayoutError if illegal.

    The step is traced on a batch of ``batch``'s shapes (default :func:`abstract_batch`) given as
    an input, and the making of the synthetic batch from a key under the same layout apart
    (:attr:`Traced.making`): its collectives are the step's too (the step train runs makes it
    first), while its memory is :attr:`Batch.making_peak`'s and the step's walk stays the same for
    a batch that comes from a data loader.
    ``platform``: the device profile's, whose attention kernel the step is traced with
    (:func:`meshdsl.nn.attention_impl.traced_for`: cuDNN's fused attention for a GPU); None: the host's.
    ``results``: the step's global result shapes (:func:`step_results`, the same under every layout), else
    traced here on global arrays: a third of a step's tracing, which the search does once, not per candidate.
    ``state``: the training state's global shapes (:func:`meshdsl.planner.search.abstract_state`, the same under
    every layout), else traced here.
    """
    mesh = md.Mesh.abstract(axis_sizes)
    trainer = Trainer(model, optimizer, mesh, layout, grad_reduce_dtype=grad_reduce_dtype)
    state = trainer.abstract_state() if state is None else state
    batch = abstract_batch(model) if batch is None else batch
    with traced_for(platform):
        closed = jax.make_jaxpr(functools.partial(trainer.step.spmd_function, shapes=results))(state, batch.shapes)
    making = jax.make_jaxpr(md.compile(model.batch, mesh, layout).spmd_function)(_KEY)
    return Traced(closed.jaxpr, making.jaxpr, state, batch, mesh, layout)


def step_results(model: Model, optimizer: Any, batch: Batch) -> Any:
    """The global shapes of one training step's results (new state and loss), traced on global arrays: the
    same under every layout (a layout never changes a shape), so :func:`trace_step` can take them once."""
    trainer = Trainer(model, optimizer, md.Mesh.abstract({"data": 1}), md.Layout())
    with use(GlobalLowering()):
        return jax.eval_shape(trainer.step.fn, trainer.abstract_state(), batch.shapes)


def shard_map_body(jaxpr: Any) -> Any:
    """The per-device jaxpr inside the program's one ``shard_map``."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            return called("shard_map", eqn.params)
    raise ValueError("the traced step has no shard_map")
