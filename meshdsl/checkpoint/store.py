"""Checkpoints that describe themselves and reshard on load.

A checkpoint is a directory: ``manifest.json`` (format version, each leaf's pytree path, kind,
dtype, global shape and, for an ``md.Tensor``, its named dims; plus the caller's metadata) and
one zarr v3 array per array leaf under ``arrays/``, written and read with tensorstore.

``save`` writes each array in chunks of the shard shape it has on the saving mesh, and each
process writes only the shards its devices hold with ``replica_id == 0``: replicated data is
written once, and no two processes touch one chunk. Everything goes into a sibling directory
``<path>.partial-<token>``; when every process has finished, process 0 writes the manifest,
fsyncs, and renames it to ``path``. A crash leaves at most a ``.partial-`` directory, which
nothing takes for a checkpoint. Pruning is the same in reverse: a checkpoint is first renamed to
``<path>.deleted-<token>`` (un-committed at once), then deleted.

``restore`` lays every ``md.Tensor`` out on any mesh under any layout: each process reads only
the slices its own devices hold (``jax.make_array_from_callback``), whatever the saving mesh was.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import jax
import numpy as np
import tensorstore as ts
from jax.sharding import NamedSharding, PartitionSpec

from meshdsl.checkpoint.lock import DirLock
from meshdsl.dims import Dim, Shape
from meshdsl.errors import ConfigError, DataError, LayoutError, MeshDslError, WriteError
from meshdsl.layout import Layout
from meshdsl.mesh import Mesh
from meshdsl.runtime import output_paths
from meshdsl.tensor import Tensor, is_tensor

FORMAT = "meshdsl-checkpoint"
VERSION = 2
"""Version 2 adds the manifest's ``checksum``; version 1 checkpoints (without one) are still read."""
MANIFEST = "manifest.json"
_STEP = re.compile(r"^step_(\d+)$")
_LEFTOVER = re.compile(r"^step_\d+\.(partial|old|deleted)-")
"""What crashed saves and prunes leave: unfinished, swapped-out and un-committed checkpoints."""
_CODECS = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
_PLAIN = (bool, int, float, str, type(None))


def _is_leaf(x: Any) -> bool:
    """A checkpoint's leaves: md Tensors whole, and ``None`` (which JAX's pytrees would drop)."""
    return x is None or isinstance(x, Tensor)


def _checksum(manifest: dict[str, Any]) -> str:
    """SHA-256 of the manifest without its ``checksum``, in one canonical JSON form."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _check_path(where: str, name: str, value: Any) -> Path:
    """``value`` as a Path; ConfigError naming the argument when it is not a path (arguments swapped)."""
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(
            f"{where}: {name} is a {type(value).__name__}, not a path (str or os.PathLike); were the arguments swapped?"
        )
    return Path(value)


def _key(entry: Any) -> dict[str, Any]:
    """A pytree path entry as JSON: ``{"key": k}``, ``{"attr": name}`` or ``{"index": i}``."""
    if isinstance(entry, jax.tree_util.DictKey):
        if not isinstance(entry.key, (str, int)):
            raise DataError(f"checkpoint: dict key {entry.key!r} is neither a str nor an int")
        return {"key": entry.key}
    if isinstance(entry, jax.tree_util.GetAttrKey):
        return {"attr": entry.name}
    if isinstance(entry, jax.tree_util.SequenceKey):
        return {"index": entry.idx}
    if isinstance(entry, jax.tree_util.FlattenedIndexKey):
        return {"index": entry.key}
    raise DataError(f"checkpoint: unsupported pytree path entry {entry!r}")


def _leaves(tree: Any) -> list[tuple[str, list[dict[str, Any]], Any]]:
    """(path string, path as JSON, leaf) for every leaf; an ``md.Tensor`` is one leaf."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_leaf)[0]
    return [(jax.tree_util.keystr(path), [_key(e) for e in path], leaf) for path, leaf in flat]


def _process_zero() -> bool:
    return jax.process_index() == 0


def _barrier(name: str) -> None:
    """Wait for every process (a no-op with one)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _token() -> str:
    """A random token, the same on every process (process 0's, broadcast)."""
    token = uuid.uuid4().bytes
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        token = np.asarray(multihost_utils.broadcast_one_to_all(np.frombuffer(token, np.uint8))).tobytes()
    return token.hex()[:12]


def _reason(e: Exception) -> str:
    """A tensorstore error's message on one line, without the spec JSON and source locations it appends."""
    text = re.sub(r"\s*\[(tensorstore_spec|source locations)='.*?'\]", "", str(e), flags=re.S)
    return " ".join(text.split())


def _ts_spec(path: Path) -> dict[str, Any]:
    return {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}


def _describe(where: str, leaf: Any, index: int) -> dict[str, Any]:
    """The manifest record of one leaf (without its path)."""
    if isinstance(leaf, _PLAIN):
        return {"kind": "value", "value": leaf}
    if is_tensor(leaf):
        if leaf.pending:
            raise DataError(f"checkpoint: leaf {where} holds pending partial sums; save the global value")
        kind, array = "tensor", leaf.array
    elif isinstance(leaf, jax.Array):
        kind, array = "array", leaf
    elif isinstance(leaf, (np.ndarray, np.generic)):
        kind, array = "numpy", np.asarray(leaf)
    else:
        raise DataError(
            f"checkpoint: leaf {where} is a {type(leaf).__name__}; a checkpoint holds md.Tensors, arrays and plain "
            "scalars"
        )
    if jax.dtypes.issubdtype(array.dtype, jax.dtypes.prng_key):
        raise DataError(f"checkpoint: leaf {where} is a typed PRNG key; save jax.random.key_data(key) instead")
    try:
        ts.dtype(np.dtype(array.dtype).name)
    except (ValueError, TypeError):
        raise DataError(
            f"checkpoint: leaf {where} has dtype {array.dtype}, which tensorstore's zarr3 cannot store"
        ) from None
    record = {"kind": kind, "array": f"arrays/{index}", "dtype": np.dtype(array.dtype).name, "shape": list(array.shape)}
    if kind == "tensor":
        record["dims"] = [[d.name, d.size] for d in leaf.shape]
    return record


def _chunks(array: Any) -> list[int]:
    """Chunk shape: the shard shape on the saving mesh, so each chunk has one writer."""
    shape = array.sharding.shard_shape(array.shape) if isinstance(array, jax.Array) else array.shape
    return [max(1, n) for n in shape]


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root``, so the rename commits data already on disk."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            _fsync(Path(folder) / name)
        _fsync(Path(folder))


def _commit(tmp: Path, path: Path) -> None:
    """Rename the finished ``tmp`` to ``path``; an existing ``path`` is swapped out, then deleted."""
    _fsync_tree(tmp)
    old = None
    if path.exists():
        old = path.with_name(f"{path.name}.old-{tmp.name.rsplit('-', 1)[-1]}")
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync(path.parent)
    if old is not None:
        shutil.rmtree(old)


def _create(tmp: Path, arrays: list[tuple[dict[str, Any], Any]]) -> None:
    """Create ``tmp`` and an empty zarr3 array per record, chunked by the saving shard shape."""
    tmp.mkdir(parents=True)
    for record, array in arrays:
        layout = {
            "shape": record["shape"],
            "data_type": record["dtype"],
            "codecs": _CODECS,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": _chunks(array)}},
        }
        ts.open({**_ts_spec(tmp / record["array"]), "metadata": layout}, create=True).result()


def _write(tmp: Path, arrays: list[tuple[dict[str, Any], Any]]) -> None:
    """Write this process's share: its devices' shards with ``replica_id == 0`` (numpy leaves: process 0)."""
    writes = []
    for record, array in arrays:
        store = ts.open({**_ts_spec(tmp / record["array"]), "store_data_equal_to_fill_value": True}, open=True).result()
        if isinstance(array, jax.Array):
            writes += [store[s.index].write(np.asarray(s.data)) for s in array.addressable_shards if s.replica_id == 0]
        elif _process_zero():
            writes.append(store.write(np.asarray(array)))
    for w in writes:
        w.result()


def _check_target(path: Path) -> None:
    """ConfigError unless a checkpoint can be committed at ``path`` without losing anything: ``path``
    is new, an empty directory or a checkpoint (to replace), and its directory is writable."""
    output_paths.check_dir(path, "checkpoint")
    output_paths.check_dir(path.parent, f"checkpoint {str(path)!r}: its directory")
    if path.is_dir() and not (path / MANIFEST).is_file() and any(path.iterdir()):
        raise ConfigError(
            f"checkpoint {str(path)!r} is a directory that holds files but no {MANIFEST}; saving would replace it, so "
            "choose another path"
        )


def save(path: str | Path, state: Any, *, metadata: dict[str, Any] | None = None) -> Path:
    """Write ``state`` (a pytree of md Tensors, arrays and plain scalars) to the directory ``path``.

    Every process must call it with the same tree. Returns ``path`` once committed. An existing
    checkpoint (or empty directory) at ``path`` is replaced only after the new one is complete;
    anything else there (a file, a directory of other files) is a ConfigError before anything is written.
    """
    path = _check_path("checkpoint.save(path, state)", "path", path)
    _check_target(path)
    if metadata is not None and not isinstance(metadata, dict):
        raise DataError(f"checkpoint {str(path)!r}: metadata is a {type(metadata).__name__}; give a dict of plain JSON")
    metadata = dict(metadata or {})
    try:
        json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise DataError(f"checkpoint {str(path)!r}: metadata is not plain JSON: {e}") from None
    leaves = _leaves(state)
    records = [
        {"path": where, "keys": keys, **_describe(where, leaf, i)} for i, (where, keys, leaf) in enumerate(leaves)
    ]
    arrays = [
        (r, leaf.array if is_tensor(leaf) else leaf) for r, (_, _, leaf) in zip(records, leaves) if r["kind"] != "value"
    ]
    tmp = path.with_name(f"{path.name}.partial-{_token()}")
    try:
        if _process_zero():
            _create(tmp, arrays)
        _barrier(f"meshdsl.checkpoint.created:{tmp.name}")
        _write(tmp, arrays)
        _barrier(f"meshdsl.checkpoint.written:{tmp.name}")
        if _process_zero():
            created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            manifest = {
                "format": FORMAT,
                "version": VERSION,
                "created": created,
                "processes": jax.process_count(),
                "leaves": records,
                "metadata": metadata,
            }
            manifest["checksum"] = _checksum(manifest)
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
            _commit(tmp, path)
    except MeshDslError:
        raise
    except (OSError, ValueError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        cause = f"{e.strerror} ({e.filename})" if isinstance(e, OSError) and e.strerror else _reason(e)
        raise WriteError(f"checkpoint {str(path)!r} could not be written: {cause}") from None
    _barrier(f"meshdsl.checkpoint.committed:{tmp.name}")
    return path


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path``; DataError if missing, foreign or malformed."""
    path = _check_path("checkpoint.read_manifest(path)", "path", path)
    if not path.is_dir():
        raise DataError(f"checkpoint {str(path)!r} not found")
    file = path / MANIFEST
    if not file.is_file():
        raise DataError(f"{str(path)!r} is not a meshdsl checkpoint (foreign directory: no {MANIFEST})")
    try:
        manifest = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(
            f"{str(path)!r} is not a meshdsl checkpoint (foreign directory: {MANIFEST} is not JSON: {e})"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(
            f"{str(path)!r} is not a meshdsl checkpoint (foreign directory: {MANIFEST} has no format {FORMAT!r})"
        )
    if manifest.get("version") not in (1, VERSION):
        raise DataError(
            f"checkpoint {str(path)!r} has format version {manifest.get('version')!r}; this meshdsl reads versions 1 "
            f"to {VERSION}"
        )
    if not isinstance(manifest.get("leaves"), list) or not isinstance(manifest.get("metadata"), dict):
        raise DataError(f"checkpoint {str(path)!r} is corrupt: {MANIFEST} lacks its leaves or metadata")
    for record in manifest["leaves"]:
        if not _well_formed(record):
            raise DataError(
                f"checkpoint {str(path)!r} is corrupt: malformed leaf record in {MANIFEST}: {json.dumps(record)[:200]}"
            )
    if manifest["version"] > 1 and manifest.get("checksum") != _checksum(manifest):
        raise DataError(
            f"checkpoint {str(path)!r} is corrupt: {MANIFEST} does not match its checksum "
            "(it was edited or damaged after the save: a leaf could load another array)"
        )
    return manifest


def _well_formed(record: Any) -> bool:
    """Whether a manifest leaf record has the fields its kind needs, with the right types."""
    if (
        not isinstance(record, dict)
        or not isinstance(record.get("path"), str)
        or not isinstance(record.get("keys"), list)
    ):
        return False
    if not all(
        isinstance(e, dict) and len(e) == 1 and next(iter(e)) in ("key", "attr", "index") for e in record["keys"]
    ):
        return False
    kind = record.get("kind")
    if kind == "value":
        return "value" in record
    shape = record.get("shape")
    if (
        kind not in ("tensor", "array", "numpy")
        or not isinstance(record.get("array"), str)
        or not isinstance(record.get("dtype"), str)
    ):
        return False
    if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
        return False
    dims = record.get("dims")
    return kind != "tensor" or (
        isinstance(dims, list) and [d[1] if isinstance(d, list) and len(d) == 2 else None for d in dims] == shape
    )


def _shape_of(record: dict[str, Any]) -> Shape:
    return Shape(Dim(name, size) for name, size in record["dims"])


def _check_like(path: Path, records: list[dict[str, Any]], like: Any) -> tuple[Any, list[dict[str, Any]]]:
    """The tree structure of ``like`` and the records in its leaf order, after checking them against each other."""
    expected = _leaves(like)
    saved = {r["path"]: r for r in records}
    missing = [w for w, _, _ in expected if w not in saved]
    extra = sorted(set(saved) - {w for w, _, _ in expected})
    if missing or extra:
        raise DataError(
            f"checkpoint {str(path)!r} does not match the expected state: missing leaves {missing}, unexpected leaves "
            f"{extra}"
        )
    for where, _, leaf in expected:
        record = saved[where]
        if record["kind"] == "value":
            continue
        if is_tensor(leaf):
            have = (
                str(_shape_of(record)) if record["kind"] == "tensor" else f"an array of shape {tuple(record['shape'])}"
            )
            if record["kind"] != "tensor" or _shape_of(record) != leaf.shape:
                raise DataError(
                    f"checkpoint {str(path)!r}: leaf {where} is {have}, but the expected state has {leaf.shape}"
                )
        elif tuple(record["shape"]) != tuple(np.shape(leaf)):
            raise DataError(
                f"checkpoint {str(path)!r}: leaf {where} has shape {tuple(record['shape'])}, but the expected state "
                f"has {tuple(np.shape(leaf))}"
            )
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and np.dtype(dtype).name != record["dtype"]:
            raise DataError(
                f"checkpoint {str(path)!r}: leaf {where} has dtype {record['dtype']}, but the expected state has "
                f"{np.dtype(dtype).name}"
            )
    return jax.tree_util.tree_structure(like, is_leaf=_is_leaf), [saved[w] for w, _, _ in expected]


def _open(path: Path, record: dict[str, Any]) -> ts.TensorStore:
    """The stored array of ``record``, checked against the manifest; DataError when missing or altered."""
    where = f"checkpoint {str(path)!r}: leaf {record['path']}"
    try:
        store = ts.open({**_ts_spec(path / record["array"]), "fill_missing_data_reads": False}, open=True).result()
    except ValueError as e:
        raise DataError(
            f"{where}: array {record['array']} is missing or unreadable (corrupt checkpoint): {_reason(e)}"
        ) from None
    if tuple(store.shape) != tuple(record["shape"]) or store.dtype.name != record["dtype"]:
        raise DataError(
            f"{where}: array {record['array']} holds {store.dtype.name}{list(store.shape)}, but the manifest says "
            f"{record['dtype']}{record['shape']} (corrupt checkpoint)"
        )
    return store


def _result(path: Path, record: dict[str, Any], future: Any) -> np.ndarray:
    """A read's data; DataError when the stored chunks are missing, truncated or fail their checksum."""
    try:
        return future.result()
    except ValueError as e:
        raise DataError(
            f"checkpoint {str(path)!r}: leaf {record['path']}: array {record['array']} is corrupt: {_reason(e)}"
        ) from None


def _span(index: tuple[slice, ...] | None) -> tuple:
    """A device's block index as a hashable key. JAX types the index optional, but asserts that it is not None."""
    assert index is not None
    return tuple((s.start, s.stop, s.step) for s in index)


def _load(path: Path, record: dict[str, Any], mesh: Mesh, layout: Layout) -> Any:
    """One leaf, laid out on ``mesh``; each process reads only its devices' slices."""
    if record["kind"] == "value":
        return record["value"]
    store = _open(path, record)
    if record["kind"] == "numpy":
        return _result(path, record, store.read())
    shape = tuple(record["shape"])
    if record["kind"] == "tensor":
        named = _shape_of(record)
        layout.axes(named, mesh, tensor=f"checkpoint leaf {record['path']}")
        sharding = NamedSharding(mesh.jax_mesh, layout.spec(named))
    else:
        sharding = NamedSharding(mesh.jax_mesh, PartitionSpec())
    wanted = {_span(i): i for i in sharding.addressable_devices_indices_map(shape).values()}
    pending = {span: store[index].read() for span, index in wanted.items()}
    blocks = {span: _result(path, record, future) for span, future in pending.items()}
    array = jax.make_array_from_callback(shape, sharding, lambda index: blocks[_span(index)])
    return Tensor(array, _shape_of(record)) if record["kind"] == "tensor" else array


def _nest(node: Any) -> Any:
    """Dicts keyed ``(is_index, key)`` as lists (all keys indices) or dicts (keys and attributes)."""
    if not isinstance(node, dict):
        return node
    items = {k: _nest(v) for k, v in node.items()}
    if items and all(is_index for is_index, _ in items):
        return [v for (_, _), v in sorted(items.items(), key=lambda kv: kv[0][1])]
    return {key: v for (_, key), v in items.items()}


def _rebuild(records: list[dict[str, Any]], leaves: list[Any]) -> Any:
    """The tree from the saved paths: dicts for keys and attributes, lists for indices."""
    root: dict = {}
    for record, leaf in zip(records, leaves):
        keys = [("index" in e, e.get("key", e.get("attr", e.get("index")))) for e in record["keys"]]
        if not keys:
            return leaf
        node = root
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = leaf
    return _nest(root)


def restore(
    path: str | Path, mesh: Mesh, layout: Layout | str | None = None, *, like: Any = None
) -> tuple[Any, dict[str, Any]]:
    """``(state, metadata)`` from the checkpoint at ``path``, laid out on ``mesh`` under ``layout``.

    Every md Tensor is split as ``layout.param_layout`` says for its named dims (a checkpoint holds
    parameters and optimizer state: with FSDP's ``params`` rules they are split as stored); other
    jax arrays come back replicated over ``mesh``,
    numpy arrays as numpy arrays, plain scalars as they were. With ``like`` (a pytree of the
    expected leaves: arrays, md Tensors, ``jax.ShapeDtypeStruct``, e.g. from ``jax.eval_shape``)
    the state has ``like``'s tree structure and every leaf's shape and dtype are checked;
    without it, the structure is rebuilt from the saved paths as nested dicts and lists.
    """
    path = _check_path("checkpoint.restore(path, mesh, layout)", "path", path)
    if not isinstance(mesh, Mesh):
        raise ConfigError(
            f"checkpoint.restore(path, mesh, layout): mesh is a {type(mesh).__name__}, not an md.Mesh; "
            "the path comes first, then the mesh, then the layout"
        )
    if layout is not None and not isinstance(layout, (Layout, str)):
        raise ConfigError(
            f"checkpoint.restore(path, mesh, layout): layout is a {type(layout).__name__}; give an md.Layout, rules "
            "or None"
        )
    manifest = read_manifest(path)
    layout = (layout if isinstance(layout, Layout) else Layout(layout)).param_layout
    records = manifest["leaves"]
    if like is not None:
        treedef, records = _check_like(path, records, like)
    try:
        leaves = [_load(path, r, mesh, layout) for r in records]
    except LayoutError as e:
        raise LayoutError(f"checkpoint {str(path)!r} does not fit mesh {mesh} under layout {layout}: {e}") from None
    state = treedef.unflatten(leaves) if like is not None else _rebuild(records, leaves)
    return state, manifest["metadata"]


def steps(directory: str | Path) -> list[int]:
    """Steps of the committed checkpoints ``step_<N>`` (holding a manifest) in ``directory``, ascending.

    Unfinished saves (``.partial-``), swapped-out (``.old-``) and pruned (``.deleted-``) directories never count.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _STEP.match(p.name))]
    return sorted(step for step, p in found if (p / MANIFEST).is_file())


def latest(directory: str | Path) -> Path | None:
    """The committed checkpoint with the highest step in ``directory``, or None."""
    found = steps(directory)
    return Path(directory) / f"step_{found[-1]}" if found else None


def _count(name: str, value: Any) -> int:
    """``value`` if it is an int (not a bool); ConfigError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{name} is {value!r} (a {type(value).__name__}); it must be an integer")
    return int(value)


class CheckpointManager:
    """Checkpoints ``step_<N>`` of one training run in ``directory``.

    ``save_every``: save when the step is a multiple of it (0: only when asked). ``keep``: after
    each commit, delete all but the newest ``keep`` checkpoints (None: keep all). The first save
    (or :meth:`acquire`) locks the directory for this run (:mod:`meshdsl.checkpoint.lock`) until
    :meth:`release` or the process ends: a second run on it is refused.
    """

    def __init__(self, directory: str | Path, save_every: int = 0, keep: int | None = 3):
        directory = _check_path("CheckpointManager(directory)", "directory", directory)
        save_every = _count("save_every", save_every)
        if save_every < 0:
            raise ConfigError(f"save_every is {save_every}; it must be 0 (only at the end) or a positive step count")
        if keep is not None and _count("keep", keep) < 1:
            raise ConfigError(f"keep is {keep}; a run keeps at least 1 checkpoint")
        if (directory / MANIFEST).is_file():
            raise ConfigError(
                f"checkpoint dir {str(directory)!r} is itself a checkpoint (it holds {MANIFEST}); "
                f"give the directory that holds it, {str(directory.parent)!r}"
            )
        self.directory, self.save_every, self.keep = directory, save_every, keep
        self._lock = DirLock(directory)

    def acquire(self) -> str | None:
        """Lock the directory for this run (process 0 takes the lock; every process learns the
        outcome). Returns a note when a dead run's lock was taken over; ConfigError when another
        run holds it."""
        refused = None
        note = None
        if _process_zero():
            try:
                note = self._lock.acquire()
            except ConfigError as e:
                refused = e
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            held = int(np.asarray(multihost_utils.broadcast_one_to_all(np.int32(refused is None))))
            if not held and refused is None:
                where = str(self.directory)
                refused = ConfigError(
                    f"checkpoint dir {where!r} is in use by another run (process 0 could not lock it)"
                )
        if refused is not None:
            raise refused
        return note

    def release(self) -> None:
        """Unlock the directory (a no-op when this manager holds no lock)."""
        self._lock.release()

    def path(self, step: int) -> Path:
        return self.directory / f"step_{step}"

    def steps(self) -> list[int]:
        return steps(self.directory)

    def latest(self) -> Path | None:
        return latest(self.directory)

    def due(self, step: int) -> bool:
        """Whether ``save_every`` asks for a checkpoint after ``step``."""
        return self.save_every > 0 and step % self.save_every == 0

    def save(self, step: int, state: Any, metadata: dict[str, Any] | None = None) -> Path:
        """Save ``state`` as ``step_<step>`` (``metadata["step"] = step``), then drop stale and old checkpoints.

        A save that cannot be written (disk full, read-only, a file size limit) is a WriteError
        naming the step, the cause and the newest intact checkpoint; nothing of it is left behind.
        """
        if _count("step", step) < 0:
            raise ConfigError(f"step is {step}; checkpoints are numbered by steps of 0 or more")
        self.acquire()
        if _process_zero():
            self._remove_leftovers()
        try:
            path = save(self.path(step), state, metadata={**(metadata or {}), "step": step})
        except WriteError as e:
            intact = self.latest()
            kept = f"the newest intact checkpoint is {str(intact)!r}" if intact else "no earlier checkpoint exists here"
            raise WriteError(f"checkpoint of step {step} not saved: {e}; {kept}") from None
        if _process_zero() and self.keep is not None:
            for old in self.steps()[: -self.keep]:
                _prune(self.path(old))
        _barrier(f"meshdsl.checkpoint.pruned:{path.name}")
        return path

    def check_free(self, steps: range) -> None:
        """ConfigError, before a run's work, unless each of ``steps`` (those the run may save: a
        signal can stop it after any) can be saved: its ``step_<N>`` is absent, an empty folder or a
        checkpoint, never a file or a folder of other files, which :func:`save` would refuse only then."""
        if not self.directory.is_dir():
            return
        for p in sorted(self.directory.iterdir()):
            m = _STEP.match(p.name)
            if m and int(m.group(1)) in steps:
                try:
                    _check_target(p)
                except ConfigError as e:
                    raise ConfigError(f"{e} (this run would save its step {m.group(1)} there)") from None

    def _remove_leftovers(self) -> None:
        """Delete what crashed saves and prunes left (``step_<N>.partial-*``, ``.old-*``, ``.deleted-*``)."""
        if self.directory.is_dir():
            for p in self.directory.iterdir():
                if _LEFTOVER.match(p.name):
                    shutil.rmtree(p)


def _prune(path: Path) -> None:
    """Delete the checkpoint at ``path`` as atomically as it was saved: un-commit it first (rename it
    to ``<path>.deleted-<token>``, which :func:`steps` never lists; fsync), then delete the files. A
    crash in between leaves a ``.deleted-`` directory, which the next save removes."""
    tomb = path.with_name(f"{path.name}.deleted-{uuid.uuid4().hex[:12]}")
    os.replace(path, tomb)
    _fsync(path.parent)
    shutil.rmtree(tomb)
