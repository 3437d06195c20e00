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
import importlib.resources
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

import meshdsl as md
from meshdsl.lowering.recorder import recorded_shapes

LAYOUTS = Path(str(importlib.resources.files("meshdsl.layouts"))).resolve()
"""The shipped layout files: the package data of ``meshdsl.layouts`` (the repository's
``layouts/`` folder), found wherever meshdsl is installed."""


def model_dims(model: Any) -> set[str]:
    """Names of the dims of every tensor in ``model``'s loss: parameters, batch and activations.

    The loss is traced on global arrays (``jax.eval_shape``): nothing is compiled or computed.
    """
    def loss(key: jax.Array) -> jax.Array:
        return model.loss(model.init(key), model.batch(key)).array

    return {name for shape in recorded_shapes(loss, jax.ShapeDtypeStruct((2,), jnp.uint32)) for name in shape.names}


def is_shipped(path: str | Path | None) -> bool:
    """Whether ``path`` is one of the shipped layout files."""
    return path is not None and Path(path).resolve().parent == LAYOUTS


def unused_rules(layout: md.Layout, model: Any, name: str) -> list[str]:
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
            out.append(f"layout {table} {dim}:{','.join(axes)} names no dim of model {name} (its dims: {shown}), so it splits nothing{guess}")
    return out
