"""Hugging Face checkpoints in and out: ``md.hf.model``, ``md.hf.load`` and ``md.hf.save``.

A Hugging Face model folder (``config.json`` and ``model.safetensors``, or shards with
``model.safetensors.index.json``) of the Llama (1 to 3.2), Mistral, Qwen2/2.5, Qwen3 or Gemma family
becomes the shipped llama decoder (``meshdsl.models.llama``) with that family's switches
(:mod:`meshdsl.hf.config` reads the file, naming any field it does not model), and its weights are read
with ``md.checkpoint.load_safetensors`` (each device reading only its block) under the names of
``Model.hf_names()``. ``save`` writes such a folder back (:mod:`meshdsl.hf.write`), which
``transformers.AutoModelForCausalLM.from_pretrained`` loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax

from meshdsl.errors import ConfigError
from meshdsl.hf import config as hf_config
from meshdsl.hf.write import SHARD_BYTES, save
from meshdsl.layout import Layout
from meshdsl.mesh import Mesh

__all__ = ["SHARD_BYTES", "config_of", "load", "model", "save"]

DEFAULT_BATCH = 8
"""Rows per batch when the caller gives no ``batch`` (a checkpoint has none)."""
DEFAULT_LENGTH = 128
"""Positions per sequence when the caller gives no ``length``."""


def config_of(path: str | Path, **overrides: Any) -> Any:
    """The llama ``Config`` of the Hugging Face folder ``path``, with ``overrides`` of the fields its
    ``config.json`` does not set (``batch``, ``length``, ``compute_dtype``, ``remat``, ``loss_chunk``, ...)."""
    from meshdsl.models import llama

    where = str(Path(path) / "config.json")
    length = overrides.get("length", DEFAULT_LENGTH)
    fields = hf_config.fields(hf_config.read(path), length if isinstance(length, int) else 0, where)
    clash = sorted(set(overrides) & set(fields))
    if clash:
        raise ConfigError(
            f"hf.model: {clash[0]}={overrides[clash[0]]!r} would change the checkpoint's model; "
            f"{where} sets it ({clash[0]}={fields[clash[0]]!r})"
        )
    values = {"batch": DEFAULT_BATCH, "length": DEFAULT_LENGTH, "ignore_labels": True, **fields, **overrides}
    return llama.Config.preset("tiny", **values)  # checked as --set values are


def model(path: str | Path, **overrides: Any) -> Any:
    """The shipped llama decoder built from the folder's ``config.json`` (see :func:`config_of`)."""
    from meshdsl.models import llama

    return llama.Model(config_of(path, **overrides))


def load(path: str | Path, *, mesh: Mesh, layout: Layout | str | dict | None = None, **overrides: Any) -> tuple:
    """``(model, params)`` of the Hugging Face folder ``path``: the parameters laid out on ``mesh`` as ``layout``
    stores them (its ``[params]`` table where it has one, as a trainer's state holds them), each device reading
    only its block of the safetensors files."""
    from meshdsl.checkpoint.safetensors_io import load_safetensors

    m = model(path, **overrides)
    like = jax.eval_shape(m.init, jax.random.key(0))
    stored = Layout(layout if layout is not None else {}).param_layout
    return m, load_safetensors(path, like=like, names=m.hf_names(), mesh=mesh, layout=stored)
