"""Parameters from a safetensors checkpoint (Hugging Face's format), laid out and sharded as asked.

``load_safetensors(path, like=params, names=mapping, mesh=mesh, layout=layout)`` returns a pytree
shaped as ``like`` (a model's parameters, or ``jax.eval_shape`` of its ``init``) whose md tensors
hold the file's values, laid out on ``mesh`` by ``layout``. ``names`` maps each leaf's path
(``"layers/wq"``: dict keys joined by ``/``) to a :class:`Source`: which tensors of the file hold
it and how their axes map to the leaf's named dims. Each device's block is read on its own
(``jax.make_array_from_callback``) through ``safe_open(...).get_slice``, which reads only the
rows asked for: a device reads only its shard where the shard is a contiguous run of the file's
rows (a split of the leading dim of each file axis, and any split of a stacked dim such as
``layers``); otherwise it reads the whole of that axis and keeps its part.

Everything is checked before anything is read: the file exists, every tensor named is in it,
with the shape the leaf needs (a DataError naming the tensor, the file and both shapes) and values
of its kind (integers into a float leaf: a DataError naming both dtypes), no tensor is in two files
of a sharded folder (a DataError naming both), and the mapping covers the leaves (a ConfigError).
A float value beyond the leaf's range (float64 into float32) is a DataError when its block is read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from meshdsl.dims import Shape
from meshdsl.errors import ConfigError, DataError
from meshdsl.layout import Layout
from meshdsl.mesh import Mesh
from meshdsl.tensor import Tensor, is_tensor

_PLACEHOLDER = re.compile(r"\{(\w+)\}")


@dataclasses.dataclass(frozen=True)
class Source:
    """Where one parameter is in the file.

    ``name``: the tensor's name; a ``{dim}`` placeholder names a dim of the parameter stacked from
    one tensor per index (``"model.layers.{layers}.mlp.up_proj.weight"``), filled with
    ``0, 1, ...`` or, where given, ``values[dim]`` (``{"kv": ("k", "v")}``). ``dims``: the file
    tensor's axes as the parameter's other dims, an axis holding several dims row-major written
    in parentheses (``"(kv_heads group d_kv) d_model"``: a ``[heads * d_kv, d_model]`` matrix).
    """

    name: str
    dims: str
    values: Mapping[str, Sequence[str]] = dataclasses.field(default_factory=dict)

    def axes(self) -> list[list[str]]:
        """The file axes, each as the dim names it holds."""
        tokens = re.findall(r"\([^()]*\)|[^\s()]+", self.dims)
        bare = re.sub(r"[\s()]", "", "".join(tokens))
        if bare != re.sub(r"[\s()]", "", self.dims) or not all(t.strip("()").split() for t in tokens):
            raise ConfigError(f"Source {self.name!r}: cannot read the dims {self.dims!r} (names, groups in ())")
        return [t.strip("()").split() for t in tokens]

    def placeholders(self) -> list[str]:
        return _PLACEHOLDER.findall(self.name)

    def tensor_name(self, index: Mapping[str, int]) -> str:
        return self.name.format(**{p: self.values[p][i] if p in self.values else i for p, i in index.items()})


def _path(entries: Sequence[Any]) -> str:
    parts = []
    for e in entries:
        parts.append(str(e.key if isinstance(e, jax.tree_util.DictKey) else getattr(e, "name", getattr(e, "idx", e))))
    return "/".join(parts)


def _files(path: Path) -> list[Path]:
    """The files of a checkpoint: the file, or every ``*.safetensors`` of a directory (a sharded checkpoint)."""
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise DataError(f"load_safetensors: directory {path} holds no *.safetensors file")
        return files
    if not path.is_file():
        raise DataError(f"load_safetensors: no safetensors file at {path}")
    return [path]


def _open(stack: contextlib.ExitStack, files: list[Path]) -> dict[str, Any]:
    """Each tensor name of the checkpoint to its open file."""
    try:
        from safetensors import safe_open
    except ImportError as e:
        raise ConfigError("load_safetensors needs the safetensors package: pip install 'meshdsl[hf]'") from e
    where: dict[str, Any] = {}
    first: dict[str, Path] = {}
    for f in files:
        try:
            handle = stack.enter_context(safe_open(str(f), framework="numpy"))
        except Exception as e:  # safetensors raises its own SafetensorError for a malformed header
            raise DataError(f"load_safetensors: {f} is not a safetensors file ({e})") from e
        for key in handle.keys():
            if key in first:
                raise DataError(
                    f"load_safetensors: tensor {key!r} is in both {first[key]} and {f}; a sharded checkpoint "
                    "holds each tensor once (which copy is meant?)"
                )
            where[key], first[key] = handle, f
    return where


# safetensors' dtype names, as numpy's (the kinds: f float, i/u integer, b bool)
_FILE_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
}


def _kind(dtype: str) -> str:
    """``float``, ``integer`` or ``bool``: which values a dtype (numpy's name) holds."""
    return "float" if "float" in dtype else "bool" if dtype == "bool" else "integer"


@dataclasses.dataclass
class _Leaf:
    path: str
    shape: Shape
    dtype: Any
    source: Source
    axes: list[list[str]]
    stacked: list[str]


def _plan(path: str, leaf: Any, source: Any, where: Mapping[str, Any], label: str) -> _Leaf:
    """Check one leaf's source against the leaf and the file; DataError / ConfigError naming both."""
    if isinstance(source, (tuple, list)):
        source = Source(*source)
    if not isinstance(source, Source):
        raise ConfigError(f"load_safetensors: names[{path!r}] must be a Source (or (name, dims)), got {source!r}")
    shape: Shape = leaf.shape
    axes, stacked = source.axes(), source.placeholders()
    named = [n for group in axes for n in group] + stacked
    if sorted(named) != sorted(shape.names):
        raise ConfigError(
            f"load_safetensors: {path} has dims {list(shape.names)}, but its source {source.name!r} "
            f"({source.dims!r}) names {named}"
        )
    for p in stacked:
        if p in source.values and len(source.values[p]) != shape[p].size:
            raise ConfigError(
                f"load_safetensors: {path}: {len(source.values[p])} values for {{{p}}}, its dim is {shape[p]}"
            )
    want = [math.prod(shape[n].size for n in group) for group in axes]
    for index in itertools.product(*(range(shape[p].size) for p in stacked)):
        name = source.tensor_name(dict(zip(stacked, index)))
        if name not in where:
            raise DataError(f"load_safetensors: {label} has no tensor {name!r} (for {path})")
        reader = where[name].get_slice(name)
        stored = _FILE_DTYPES.get(reader.get_dtype(), reader.get_dtype().lower())
        if _kind(stored) != _kind(np.dtype(leaf.dtype).name):
            raise DataError(
                f"load_safetensors: tensor {name!r} in {label} is {stored}; the parameter {path} is "
                f"{np.dtype(leaf.dtype).name}, and {_kind(stored)} values are not {_kind(np.dtype(leaf.dtype).name)}s"
            )
        got = list(reader.get_shape())
        if got != want:
            raise DataError(
                f"load_safetensors: tensor {name!r} in {label} has shape {got}; "
                f"{path} {shape} needs {want} ({source.dims})"
            )
    return _Leaf(path, shape, leaf.dtype, source, axes, stacked)


def _block(leaf: _Leaf, where: Mapping[str, Any], index: tuple[slice, ...]) -> np.ndarray:
    """The block of ``leaf`` at the global ``index`` (one slice per dim), read from the file."""
    shape = leaf.shape
    spans = {n: range(*s.indices(shape[n].size)) for n, s in zip(shape.names, index)}
    file_order = [n for group in leaf.axes for n in group]
    pieces = []
    for stack_index in itertools.product(*(spans[p] for p in leaf.stacked)):
        name = leaf.source.tensor_name(dict(zip(leaf.stacked, stack_index)))
        reader = where[name].get_slice(name)
        cuts: list[slice] = []
        keep: list[slice] = []
        full: list[int] = []
        for group in leaf.axes:
            inner = math.prod(shape[n].size for n in group[1:])
            first = spans[group[0]]
            if all(len(spans[n]) == shape[n].size for n in group[1:]):  # a contiguous run of rows: read only it
                cuts.append(slice(first.start * inner, first.stop * inner))
                keep.extend(slice(None) for _ in group)
                full.extend([len(first), *(shape[n].size for n in group[1:])])
            else:
                cuts.append(slice(None))
                keep.extend(slice(spans[n].start, spans[n].stop) for n in group)
                full.extend(shape[n].size for n in group)
        part = np.asarray(reader[tuple(cuts)]).reshape(full)[tuple(keep)]
        _check_range(part, leaf, name)
        pieces.append(part)
    block = np.stack(pieces).reshape([len(spans[p]) for p in leaf.stacked] + list(pieces[0].shape))
    order = leaf.stacked + file_order
    return np.ascontiguousarray(np.transpose(block, [order.index(n) for n in shape.names])).astype(leaf.dtype)


def _checked(path: Path, like: Any, names: Mapping[str, Any], stack: contextlib.ExitStack) -> tuple:
    """Every check before a read: ``like``'s flattened leaves, tree, paths, the plan of each tensor leaf
    and the open files (kept open by ``stack``)."""
    files = _files(path)
    flat, tree = jax.tree_util.tree_flatten_with_path(like, is_leaf=is_tensor)
    paths = [_path(p) for p, _ in flat]
    unknown = sorted(set(names) - set(paths))
    if unknown:
        raise ConfigError(f"load_safetensors: names {unknown} are not parameters of like (its leaves: {paths})")
    missing = [p for p, (_, leaf) in zip(paths, flat) if isinstance(leaf, Tensor) and p not in names]
    if missing:
        raise ConfigError(f"load_safetensors: no source in names for the parameters {missing}")
    where = _open(stack, files)
    tensors = [(p, leaf) for p, (_, leaf) in zip(paths, flat) if isinstance(leaf, Tensor)]
    plans = {p: _plan(p, leaf, names[p], where, str(path)) for p, leaf in tensors}
    return flat, tree, paths, plans, where


def check_safetensors(path: str | Path, *, like: Any, names: Mapping[str, Source | tuple[str, str]]) -> None:
    """Every check :func:`load_safetensors` makes before it reads (files, names, each tensor's shape), reading
    nothing but the headers: what a command runs before it starts any device."""
    with contextlib.ExitStack() as stack:
        _checked(Path(path), like, names, stack)


def _check_range(part: np.ndarray, leaf: _Leaf, name: str) -> None:
    """A DataError where a finite value of ``part`` is beyond the float range of ``leaf``'s dtype
    (float64 into float32), which the conversion would make inf without a word."""
    if not np.issubdtype(part.dtype, np.floating) or np.dtype(part.dtype).itemsize <= np.dtype(leaf.dtype).itemsize:
        return
    biggest = float(np.finfo(leaf.dtype).max)
    finite = part[np.isfinite(part)]
    beyond = finite[np.abs(finite) > biggest]
    if beyond.size:
        raise DataError(
            f"load_safetensors: tensor {name!r} (for {leaf.path}) holds {float(beyond[0]):g}, beyond "
            f"{np.dtype(leaf.dtype).name}'s range (+-{biggest:g}); {beyond.size} such value(s) would load as inf"
        )


def load_safetensors(
    path: str | Path,
    *,
    like: Any,
    names: Mapping[str, Source | tuple[str, str]],
    mesh: Mesh,
    layout: Layout | str | Mapping | None = None,
) -> Any:
    """``like``'s pytree, every md tensor read from the safetensors checkpoint at ``path`` (see the module docstring).

    ``path``: a ``.safetensors`` file or a directory of them (a sharded checkpoint). Values are
    converted to each leaf's dtype (a bfloat16 file into float32 parameters). Leaves that are not
    md tensors are returned as they are. For a layout that stores parameters apart (FSDP's
    ``[params]`` table) pass ``layout.param_layout``, as a trainer's state holds them.
    """
    layout = Layout(layout if layout is not None else {})
    with contextlib.ExitStack() as stack:
        flat, tree, paths, plans, where = _checked(Path(path), like, names, stack)
        out = []
        for p, (_, leaf) in zip(paths, flat):
            if p not in plans:
                out.append(leaf)
                continue
            plan = plans[p]
            layout.axes(plan.shape, mesh, tensor=f"parameter {p}")
            sharding = NamedSharding(mesh.jax_mesh, layout.spec(plan.shape))
            read = functools.partial(_block, plan, where)
            array = jax.make_array_from_callback(plan.shape.sizes, sharding, read)
            out.append(Tensor(array, plan.shape))
    return jax.tree_util.tree_unflatten(tree, out)
