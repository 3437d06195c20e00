"""Layout rules checked against a model: a rule that names no dim of the model is a likely typo.

A rule for a dim no tensor has changes nothing, so ``bacth:data`` would train fully replicated
without a word. :func:`unused_rules` finds such rules and words a warning with a did-you-mean.

The shipped layouts (``layouts/*.toml``) are written for every model: ``dp_tp`` splits ``heads``,
which the MLP lacks, and ``data_parallel`` splits the MoE's ``groups``. Their rules are therefore
checked against the union of the shipped models' dims (``tests/test_bad_inputs.py`` checks that
each of their rules names a dim of some shipped model), not against the one model being run:
a shipped layout never warns. A user's layout (a file or inline rules) is checked against the
model it runs.
"""

from __future__ import annotations

import difflib

import jax
import jax.numpy as jnp

import meshdsl as md
from meshdsl.lowering.base import GlobalLowering
from meshdsl.lowering.context import use
from meshdsl.lowering.recorder import recorded_shapes
from meshdsl.model.protocol import Model
from meshdsl.tensor import is_tensor


def model_dims(model: Model) -> set[str]:
    """Names of the dims of every tensor in ``model``'s loss: parameters, batch and activations.

    The loss is traced on global arrays (``jax.eval_shape``): nothing is compiled or computed.
    """

    def loss(key: jax.Array) -> jax.Array:
        return model.loss(model.init(key), model.batch(key)).array

    return {name for shape in recorded_shapes(loss, jax.ShapeDtypeStruct((2,), jnp.uint32)) for name in shape.names}


def unused_rules(layout: md.Layout, model: Model, name: str) -> list[str]:
    """One warning per rule of ``layout`` (``[rules]`` and ``[params]``) naming no dim of ``model``."""
    dims = model_dims(model)
    shown = ", ".join(sorted(dims))
    out = []
    for table, rules in (("rule", layout.rules), ("[params] rule", layout.params.rules if layout.params else {})):
        for dim, axes in rules.items():
            if dim in dims:
                continue
            close = difflib.get_close_matches(dim, sorted(dims), n=1)
            guess = f"; did you mean {close[0]}?" if close else ""
            out.append(
                f"layout {table} {dim}:{','.join(axes)} names no dim of model {name} (its dims: {shown}), so it "
                f"splits nothing{guess}"
            )
    return out


def split_warnings(layout: md.Layout, mesh: md.Mesh, model: Model, name: str, warned: bool = False) -> list[str]:
    """A warning when ``layout`` on ``mesh`` splits no dim of ``model``, or neither its batch nor at least
    half of its parameters (a layout written for other dim names, such as ``dp_tp`` on a model whose
    batch dim is ``examples``: it splits only ``vocab``, and the step runs almost replicated).

    A dim counts as split when a rule (``[rules]`` or ``[params]``) maps it to mesh axes of more than
    one device; parameters count by elements, stored as the parameter rules say. None on one device,
    and no "splits no dim" warning when ``warned`` (:func:`unused_rules` named each rule splitting
    nothing). None for a model that cannot be traced: the step reports the model's own error.
    """
    if mesh.size == 1:
        return []
    try:
        dims, params, batch_dims = _traced(model)
    except Exception:  # the model's own mistake, reported where the step runs it
        return []

    def split(rules: md.Layout, dim: str) -> bool:
        return any(mesh.axis_sizes.get(a, 1) > 1 for a in rules.axes_of(dim))

    stored = layout.param_layout
    done = sorted(d for d in dims if split(layout, d) or split(stored, d))
    if not done:
        return (
            []
            if warned
            else [
                f"layout {layout.shown()} splits no dim of model {name} (its dims: {', '.join(dims)}), "
                f"so each of the {mesh.size} devices holds and computes everything"
            ]
        )
    if any(split(layout, d) for d in batch_dims):
        return []
    sizes = [(t.shape.size, any(split(stored, d.name) for d in t.shape)) for t in params]
    share = sum(n for n, s in sizes if s) / max(1, sum(n for n, _ in sizes))
    if share >= 0.5:
        return []
    return [
        f"layout {layout.shown()} splits only {', '.join(done)} of model {name}: {share:.0%} of its parameters and "
        f"none of its batch's dims ({', '.join(batch_dims)}), so most of the step runs replicated on each of the "
        f"{mesh.size} devices"
    ]


def _traced(model: Model) -> tuple[list[str], list[md.Tensor], list[str]]:
    """The model's dims, its parameter tensors and its batch's dims, traced on global arrays (nothing computed)."""
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    with use(GlobalLowering()):
        params = jax.tree_util.tree_leaves(jax.eval_shape(model.init, key), is_leaf=is_tensor)
        batch = jax.tree_util.tree_leaves(jax.eval_shape(model.batch, key), is_leaf=is_tensor)
    return sorted(model_dims(model)), params, sorted({d.name for t in batch for d in t.shape})
