"""``md.scan``: run a function over one dim of stacked tensors, as ``jax.lax.scan``.

A model of many identical layers keeps their parameters stacked along a ``layers`` dim and runs
one layer body under ``scan``. Unrolling a Python loop instead traces and compiles the body once
per layer: compile time and program size grow with depth. Under ``scan`` the body is traced and
compiled once and run ``layers`` times, so a 32-layer model compiles about as fast as a 2-layer
one, and per-layer rematerialisation (``remat=True``) bounds activation memory to one layer's
inputs per step.

The scanned dim is taken whole on every device (gathered first if a layout splits it); the other
dims of ``xs`` keep their layout. Parameters stored split in another layout than the rules (FSDP)
are gathered one layer at a time inside the loop, all of a layer's in one all-gather at the start
of its step, and gathered again for its backward step rather than kept (ZeRO-3): memory holds one
layer's gathered weights, and the backward loop runs one all-gather and one reduce-scatter per
layer instead of one per parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core
from jax.extend import source_info_util

from meshdsl.dims import DimLike, Shape
from meshdsl.errors import ConfigError, ShapeError
from meshdsl.lowering.context import current, op
from meshdsl.tensor import Tensor, describe, is_tensor

_DATA_MOVEMENT = frozenset(
    "all_gather all_gather_invariant reshape transpose slice dynamic_slice concatenate squeeze expand_dims "
    "broadcast_in_dim convert_element_type copy pvary".split()
)
"""Primitives that only move or retype data. Both gathers: ``all_gather_invariant`` is what
``lax.all_gather(..., to="invarying")`` binds, the gather of weights stored over an axis the
activations do not vary along."""


def _moves_data(primitive: Any, params: dict[str, Any]) -> bool:
    """Whether an equation only moves data: a data-movement primitive, or a call (a ``custom_vjp``
    such as the gather whose gradient is reduce-scattered in bf16) whose body does nothing else."""
    if primitive.name in _DATA_MOVEMENT:
        return True
    bodies = [v.jaxpr for v in params.values() if isinstance(v, jex_core.ClosedJaxpr)]
    return bool(bodies) and all(_moves_data(e.primitive, e.params) for body in bodies for e in body.eqns)


def _refetch_gathered(primitive: Any, *args: Any, **params: Any) -> bool:
    """``jax.checkpoint`` policy of a layer step that gathers stored parameters (ZeRO-3).

    Values made by data movement alone (the gather, and the reshapes, slices and casts of what it
    gathered) are recomputed in the backward pass from the stored shards rather than saved, so a
    device holds one layer's gathered weights at a time, not every layer's: autodiff of the scan
    would otherwise stack them all as residuals, which is the unsplit model FSDP exists to avoid.
    Everything else is saved as without a policy (the recomputed reshapes of activations are free).
    """
    return not _moves_data(primitive, params)


REMAT_POLICIES: dict[str, Callable[..., Any] | None] = {
    "full": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
"""``md.scan``'s ``remat`` by name: ``"full"`` (as ``True``) recomputes every activation of a step in
the backward pass; ``"dots"`` keeps the outputs of matmuls without batch dims (the projections and
feed-forward; attention's scores are batched, so recomputed) and recomputes the rest: more memory
than ``"full"``, less than none, and the matmuls are not run twice."""


def remat_policy(remat: bool | str) -> tuple[bool, Callable[..., Any] | None]:
    """``(recompute, jax.checkpoint policy)`` of ``md.scan``'s ``remat``; ConfigError for an unknown name."""
    if isinstance(remat, bool):
        return remat, None
    if remat not in REMAT_POLICIES:
        raise ConfigError(f"md.scan: remat={remat!r}: use True, False or one of {', '.join(REMAT_POLICIES)}", op="scan")
    return True, REMAT_POLICIES[remat]


def _arrays(tree: Any) -> list[Any]:
    """The arrays of a pytree of md tensors and arrays (a tensor's local array)."""
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=is_tensor)
    return [t._data if isinstance(t, Tensor) else t for t in leaves if isinstance(t, (Tensor, jax.Array))]


def _vary_like(vary: Callable[..., Any], tree: Any, like: Any) -> Any:
    """``tree`` with each array made varying (by ``vary``) along the axes its counterpart in ``like`` varies along."""

    def one(t: Any, other: Any) -> Any:
        if isinstance(t, Tensor):
            return Tensor(vary(t._data, other._data), t.shape, t.pending, t.split)
        return vary(t, other) if isinstance(t, jax.Array) else t

    return jax.tree_util.tree_map(one, tree, like, is_leaf=is_tensor)


def _leaf_type(t: Any) -> str:
    """A carry leaf's dims (or sizes) and dtype, for comparing and for messages."""
    if isinstance(t, Tensor):
        return f"{t.shape} of {jax.numpy.dtype(t.dtype).name}"
    return f"{jax.numpy.result_type(t).name}{list(np.shape(t))}"


def _check_carry(init: Any, out: Any) -> None:
    """A ShapeError unless the step's carry ``out`` has ``init``'s structure, dims and dtypes."""
    # The tree definitions typed Any: jaxlib ships no stub for its PyTreeDef.
    ins: tuple[list[Any], Any] = jax.tree_util.tree_flatten_with_path(init, is_leaf=is_tensor)
    outs: tuple[list[Any], Any] = jax.tree_util.tree_flatten_with_path(out, is_leaf=is_tensor)
    if ins[1] != outs[1]:
        raise ShapeError(
            f"md.scan: fn returns a carry shaped {outs[1]} for one shaped {ins[1]}: the carry keeps its structure",
            op="scan",
        )
    for (path, t), (_, u) in zip(ins[0], outs[0]):
        if _leaf_type(t) != _leaf_type(u):
            raise ShapeError(
                f"md.scan: fn returns the carry{jax.tree_util.keystr(path)} as {_leaf_type(u)}, but it came in as "
                f"{_leaf_type(t)}: the carry keeps its dims and dtypes",
                op="scan",
            )


@op("scan")
def scan(
    fn: Callable[[Any, Any], tuple[Any, Any]], init: Any, xs: Any, dim: DimLike, *, remat: bool | str = False
) -> tuple[Any, Any]:
    """``fn(carry, x) -> (carry, y)`` over ``dim`` of every tensor in ``xs``; returns ``(carry, ys)``.

    ``x`` holds the slices of ``xs`` (without ``dim``); ``ys`` stacks the ``y``\\ s along ``dim``
    in front. The carry keeps its shapes and dtypes. ``remat`` recomputes each step's
    activations in the backward pass instead of storing them (a name of :data:`REMAT_POLICIES`:
    which of them are stored all the same).
    """
    recompute, policy = remat_policy(remat)
    lowering = current()
    leaves, treedef = jax.tree_util.tree_flatten(xs, is_leaf=is_tensor)
    tensors = [x for x in leaves if isinstance(x, Tensor)]
    if not tensors:
        raise ShapeError("md.scan: xs holds no md tensor to scan over", op="scan")
    try:
        name = tensors[0].shape[dim].name
    except ShapeError as e:
        raise ShapeError(
            f"md.scan over {getattr(dim, 'name', dim)!r}: xs tensor {tensors[0].shape}: {e}", op="scan"
        ) from None
    length = tensors[0].shape[name].size

    def settle(carry: Any) -> Any:
        """The carry in its own layout with no pending sums, so every step's carry has one type."""
        return jax.tree_util.tree_map(
            lambda t: lowering.finish(lowering.prepare(t), t.shape) if isinstance(t, Tensor) else t,
            carry,
            is_leaf=is_tensor,
        )

    init = settle(init)
    prepared, slices = [], []
    for x in leaves:
        if not isinstance(x, Tensor) or name not in x.shape or x.shape[name].size != length:
            raise ShapeError(
                f"md.scan over {name}={length}: every tensor in xs needs that dim, got {getattr(x, 'shape', x)}",
                op="scan",
            )
        position = x.shape.index(name)
        axes = tuple(() if i == position else a for i, a in enumerate(lowering.split_of(x)))
        prepared.append(jax.numpy.moveaxis(lowering.prepare(x, axes), position, 0))
        rest = axes[:position] + axes[position + 1 :]
        slices.append((x.shape.without([name]), rest))

    # Slices stored split in another layout than the rules (FSDP parameters) are gathered at the
    # start of each step, all of a step's in one all-gather (see lowering.relayout_run.gather_together).
    gathers = [lowering.stored_gather(shape, axes) for shape, axes in slices]
    held = [(shape, axes if g is None else lowering.axes(shape)) for (shape, axes), g in zip(slices, gathers)]
    # The gather's equations keep this call's stack (md.explain names the line calling md.scan), not
    # that of whichever transformation traces the step again later.
    called_from = source_info_util.current().traceback

    def loop_inputs(carry: Any, stacked: list) -> list:
        # Varying along the carry's axes before the loop, not inside it: the body's ops then
        # use the slices of ``xs`` as they are, and the backward pass reads them from ``xs``
        # rather than from a stacked copy of every step's (varying) slice.
        return [lowering.vary_operand(a, *_arrays(carry)) for a in stacked]

    def step(carry: Any, local: list) -> tuple[Any, Any]:
        with source_info_util.user_context(called_from):
            local = lowering.gather_stored(list(local), gathers, *_arrays(init))
        x = jax.tree_util.tree_unflatten(
            treedef, [lowering.keep(a, shape, axes) for a, (shape, axes) in zip(local, held)]
        )
        out = fn(carry, x)
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise ShapeError(f"md.scan: fn(carry, x) must return (carry, y), got {describe(out)}", op="scan")
        return settle(out[0]), settle(out[1])

    made: dict[str, Any] = {}

    def carry_out(carry: Any, stacked: list) -> None:
        """Trace the step on ``carry`` and one slice of each of ``xs`` (as the loop gives them): its jaxpr and
        results' shapes, kept for the loop to run without tracing the step again."""
        made["step"] = jax.make_jaxpr(step, return_shape=True)(carry, loop_inputs(carry, stacked))

    # The loop's carry has one type, manual-axis (varying) type included, in and out. A carry
    # made inside the function (md.zeros, a constant) is the same on every device, while the
    # step's result may vary (a split slice of xs added to it): the initial carry is made to
    # vary along every axis the step's carry varies along, found by tracing the step without
    # running it (once more if that widens what the step sees).
    stacked_slices = [jax.typeof(a).update(shape=a.shape[1:]) for a in prepared]
    for _ in range(len(lowering.axis_sizes) + 1):
        jax.eval_shape(carry_out, init, stacked_slices)
        out = made["step"][1][0]
        _check_carry(init, out)
        wider = _vary_like(lowering.vary_operand, init, out)
        if all(a is b for a, b in zip(_arrays(wider), _arrays(init))):
            break
        init = wider
    arrays = loop_inputs(init, prepared)
    closed, shapes = made["step"]

    def replayed(carry: Any, local: list) -> tuple[Any, Any]:
        """The step, its jaxpr traced above run again (each equation keeps the line that traced it) when the
        loop's types are those it was traced on; else traced anew."""
        flat = jax.tree_util.tree_leaves((carry, local))
        if [jax.typeof(x) for x in flat] != list(closed.in_avals):
            return step(carry, local)
        results = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *flat)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shapes), results)

    def body(carry: Any, local: list) -> tuple[Any, Any]:
        carry, y = replayed(carry, local)
        return _vary_like(lowering.vary_like, carry, init), y

    if recompute:
        body = jax.checkpoint(body, policy=policy)
    elif any(g is not None for g in gathers):
        body = jax.checkpoint(body, policy=_refetch_gathered)
    carry, ys = jax.lax.scan(body, init, arrays)

    def stack(t: Any) -> Any:
        if not isinstance(t, Tensor):
            return t
        shape = Shape([tensors[0].shape[name], *t.shape])
        split = None if t.split is None else ((),) + t.split
        return lowering.finish(t._data, shape, split)

    return carry, jax.tree_util.tree_map(stack, ys, is_leaf=is_tensor)
