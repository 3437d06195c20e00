"""``md.hf.save``: a Hugging Face model folder from the llama decoder's parameters.

Each parameter becomes the file tensors its ``hf_names()`` source names (the inverse of
``load_safetensors``' reading: stacked dims indexed, the file's axes ordered and merged), in float32
(or ``dtype``). Tensors are written in ``hf_names()`` order into files of at most ``max_shard_bytes``
(transformers' 5 GB by default): one ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` with
``model.safetensors.index.json`` (``metadata.total_size`` and the ``weight_map``), as
``save_pretrained`` writes them. The host holds one file's tensors at a time, each fetched from the
devices on its own (a layer's slice of a stacked parameter is all that crosses), never the whole model.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from meshdsl.checkpoint.safetensors_io import Source
from meshdsl.errors import ConfigError, DataError
from meshdsl.tensor import Tensor, is_tensor

if TYPE_CHECKING:
    from meshdsl.model.protocol import HuggingFaceMapped

SHARD_BYTES = 5 * 10**9
"""transformers' default ``max_shard_size`` ("5GB")."""
DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes ``save`` writes."""


def _leaves(params: Any) -> dict[str, Tensor]:
    """Each md tensor of ``params`` by its path (dict keys joined by ``/``)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_tensor)
    return {"/".join(str(getattr(k, "key", k)) for k in path): leaf for path, leaf in flat if isinstance(leaf, Tensor)}


def _tensors(leaf: Tensor, source: Source) -> Iterator[tuple[str, Any]]:
    """``(file name, a function giving its array)`` for each file tensor of ``leaf`` under ``source``."""
    axes, stacked = source.axes(), source.placeholders()
    order = [n for group in axes for n in group]
    sizes = [math.prod(leaf.shape[n].size for n in group) for group in axes]
    for index in itertools.product(*(range(leaf.shape[p].size) for p in stacked)):
        name = source.tensor_name(dict(zip(stacked, index)))

        def value(index: tuple[int, ...] = index) -> np.ndarray:
            array = leaf.array
            names = list(leaf.shape.names)
            for p, i in zip(stacked, index):  # one slice of the stack crosses to the host, not the whole
                at = names.index(p)
                array = jax.lax.index_in_dim(array, i, at, keepdims=False)
                names.pop(at)
            block = np.asarray(jax.device_get(array))
            return np.ascontiguousarray(np.transpose(block, [names.index(n) for n in order]).reshape(sizes))

        yield name, (value, sizes)


def _plan(model: HuggingFaceMapped, params: Any) -> list[tuple[str, Any, list[int]]]:
    """Every file tensor ``(name, array function, shape)`` in ``hf_names()`` order; ConfigError for a mismatch."""
    names = model.hf_names()
    leaves = _leaves(params)
    if set(names) != set(leaves):
        extra, missing = sorted(set(leaves) - set(names)), sorted(set(names) - set(leaves))
        raise ConfigError(f"hf.save: params do not fit the model (not its: {extra}; missing: {missing})")
    for path, leaf in leaves.items():
        if not getattr(leaf.array, "is_fully_addressable", True):
            raise ConfigError(f"hf.save: {path} is split over several processes; save from one process's arrays")
    out = []
    for path, source in names.items():
        for name, (value, shape) in _tensors(leaves[path], source):
            out.append((name, value, shape))
    return out


def _shards(plan: list[tuple[str, Any, list[int]]], itemsize: int, limit: int) -> list[list[int]]:
    """Consecutive runs of ``plan``'s tensors, each run at most ``limit`` bytes (a larger tensor alone)."""
    shards: list[list[int]] = [[]]
    size = 0
    for i, (_, _, shape) in enumerate(plan):
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
    return shards


def save(
    path: str | Path,
    model: HuggingFaceMapped,
    params: Any,
    *,
    dtype: str = "float32",
    max_shard_bytes: int = SHARD_BYTES,
) -> Path:
    """Write ``model``'s ``config.json`` and ``params`` as a Hugging Face folder at ``path`` (module docstring)."""
    from safetensors.numpy import save_file

    from meshdsl.hf.config import write

    if dtype not in DTYPES:
        raise ConfigError(f"hf.save: dtype={dtype!r}; one of {', '.join(DTYPES)}")
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ConfigError(f"hf.save: max_shard_bytes={max_shard_bytes!r} must be a positive integer")
    config = write(model.config, dtype)
    plan = _plan(model, params)
    target = np.dtype(jax.numpy.dtype(dtype))
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise DataError(f"hf.save: {path} exists and is not a directory")
    path.mkdir(parents=True, exist_ok=True)
    shards = _shards(plan, target.itemsize, max_shard_bytes)
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for old in path.glob("model*.safetensors"):  # a former save's shards would be read with these
        if old.name not in files:
            old.unlink()
    weight_map: dict[str, str] = {}
    total = 0
    for file, members in zip(files, shards):
        arrays = {plan[i][0]: np.ascontiguousarray(plan[i][1]().astype(target)) for i in members}
        save_file(arrays, str(path / file), metadata={"format": "pt"})
        os.chmod(path / file, 0o644)
        weight_map |= {name: file for name in arrays}
        total += sum(a.nbytes for a in arrays.values())
    index = path / "model.safetensors.index.json"
    if len(files) > 1:
        index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    elif index.exists():
        index.unlink()
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path
