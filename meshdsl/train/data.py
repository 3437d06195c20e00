"""Token data from a file, read by memory map: shuffled windows, each process reading only its rows.

A token file is a ``.npy`` array of token ids, or raw little-endian ``uint16`` / ``uint32``
(``.bin``, ``.u16``, ``.u32``: pass ``dtype`` for other names; any other suffix is a DataError,
not a guess). Its ids are scanned once, when it is opened (memory-mapped, in chunks): an id outside
``[0, vocab)`` is a DataError naming the id and its position before any step runs.

The file is cut into windows of ``length + 1`` tokens, window ``w`` starting at token ``w * length``
(inputs: its first ``length`` tokens, targets: its last ``length``). The last ``eval_fraction`` of
the file is held out: training windows lie wholly before it, :meth:`TokenFile.eval_batch_at` reads
windows from it. Training visits its windows in a seeded order, a fresh permutation every epoch
(grain's ``MapDataset.range(windows).shuffle(seed)``: random access, so row ``r`` of step ``s``, the
example ``s * batch + r``, is found without reading any other). A step's batch therefore depends
only on the seed and the step: a run resumed at step ``s`` reads the batches an uninterrupted run
reads, and :meth:`TokenFile.state` (saved in the checkpoint) lets a resume check that the file,
seed and window size are the ones the checkpoint was trained on.

The batch arrays are built with ``jax.make_array_from_callback``: JAX asks each process only for
the blocks its own devices hold under the layout's rule for the model's batch dim, and the callback
reads only those rows from the map.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np

import meshdsl as md
from meshdsl.errors import ConfigError, DataError
from meshdsl.train.token_batch import TokenBatch

RAW_DTYPES = {".bin": np.uint16, ".u16": np.uint16, ".u32": np.uint32}
KNOWN = ".npy (a numpy array), .bin or .u16 (raw uint16), .u32 (raw uint32)"
"""The suffixes a token file may have (another name needs ``dtype``)."""
EVAL_FRACTION = 0.05
"""The part of a token file held out for evaluation by default (its tail)."""
CHUNK = 1 << 22
"""Tokens read at a time by the scan of the ids."""

_scanned: dict[tuple, int] = {}
"""Files whose ids were scanned in this process: (path, inode, size, mtime, vocab) -> CRC32 of the bytes."""


class TokenFile:
    """Batches of the model's inputs and targets (keys and dims of ``spec``) from a token file.

    ``vocab``: ids must lie in ``[0, vocab)``. ``seed``: the order of the training windows (only
    its low 32 bits count). ``eval_fraction``: the tail held out for :meth:`eval_batch_at`.
    """

    def __init__(
        self,
        path: str | Path,
        spec: TokenBatch,
        vocab: int,
        dtype: Any = None,
        *,
        seed: int = 0,
        eval_fraction: float = EVAL_FRACTION,
    ):
        self._settle(path, spec, vocab, eval_fraction)
        if vocab - 1 > np.iinfo(spec.dtype).max:
            raise ConfigError(f"vocab {vocab} does not fit the model's token dtype {np.dtype(spec.dtype)}")
        self.tokens = _open(self.path, dtype, self.length)
        n = len(self.tokens)
        self.train_tokens = n - int(eval_fraction * n)
        self.windows = (self.train_tokens - 1) // self.length
        """Training windows: the ones wholly before the held-out tail."""
        self.eval_windows = (n - self.train_tokens - 1) // self.length if n > self.train_tokens else 0
        """Held-out windows (0 when the tail is shorter than one window)."""
        if self.windows < 1:
            raise DataError(
                f"{self._where} has {n} tokens; a window needs at least {self.length + 1} before the "
                f"held-out tail ({n - self.train_tokens} tokens, --eval-fraction {eval_fraction})"
            )
        self.crc32 = _scan(self.path, self.tokens, vocab)
        self.seed = seed % 2**32
        self.order = grain.MapDataset.range(self.windows).shuffle(seed=self.seed)

    def _settle(self, path: str | Path, spec: TokenBatch, vocab: int, eval_fraction: float) -> None:
        """What every file of batches keeps (its path, spec, vocab and batch shape), the held-out fraction checked."""
        self.path, self.spec, self.vocab = Path(path), spec, vocab
        self.batch, self.length = spec.rows.size, spec.positions.size
        if not 0 <= eval_fraction < 1:
            raise ConfigError(f"--eval-fraction {eval_fraction}: the held-out tail is a fraction in [0, 1)")

    @property
    def _where(self) -> str:
        return f"token file {str(self.path)!r}"

    def window_of(self, example: int) -> int:
        """The training window of global example ``example`` (row ``r`` of step ``s`` is ``s * batch + r``)."""
        return int(self.order[example])

    def batch_at(self, step: int, mesh: md.Mesh, layout: md.Layout) -> dict[str, md.Tensor]:
        """The training batch of ``step``, laid out on ``mesh`` as ``layout`` says for the model's batch dims."""
        return self._batch(lambda r: self.window_of(step * self.batch + r) * self.length, mesh, layout)

    def eval_batch_at(self, index: int, mesh: md.Mesh, layout: md.Layout) -> dict[str, md.Tensor]:
        """Held-out batch ``index``: the tail's windows ``index * batch + r`` in file order (cycling),
        which no training batch reads. DataError when the tail holds no window."""
        if self.eval_windows < 1:
            held = len(self.tokens) - self.train_tokens
            raise DataError(
                f"{self._where}: its held-out tail of {held} tokens holds no window of {self.length + 1}; "
                "pass a larger --eval-fraction"
            )
        first = index * self.batch
        return self._batch(lambda r: self.train_tokens + (first + r) % self.eval_windows * self.length, mesh, layout)

    def abstract_batch(self, mesh: md.Mesh, layout: md.Layout) -> dict[str, md.Tensor]:
        """A batch's shapes, dtype and sharding with nothing read: what a step compiles for."""
        shape = self.spec.shape
        array = jax.ShapeDtypeStruct(shape.sizes, self.spec.dtype, sharding=layout.sharding(mesh, shape))
        return {self.spec.inputs: md.Tensor(array, shape), self.spec.targets: md.Tensor(array, shape)}

    def _batch(self, start_of: Any, mesh: md.Mesh, layout: md.Layout) -> dict[str, md.Tensor]:
        """Inputs and targets: each device block reads only its rows' windows (``start_of(row)``), once for both."""
        shape = self.spec.shape
        sharding = layout.sharding(mesh, shape)
        read: dict[tuple[int, int, int], np.ndarray] = {}

        def windows(rows: range) -> np.ndarray:
            key = (rows.start, rows.stop, rows.step)
            if key not in read:
                read[key] = self._read([start_of(r) for r in rows])
            return read[key]

        def make(shift: int) -> md.Tensor:
            def block(index: tuple[slice, ...] | None) -> np.ndarray:
                assert index is not None  # typed optional by JAX, which asserts it is not None before each call
                return windows(range(*index[0].indices(self.batch)))[:, shift : shift + self.length][:, index[1]]

            return md.Tensor(jax.make_array_from_callback(shape.sizes, sharding, block), shape)

        return {self.spec.inputs: make(0), self.spec.targets: make(1)}

    def _read(self, starts: list[int]) -> np.ndarray:
        """The windows of ``length + 1`` tokens at ``starts``, in the model's dtype (ids were range-checked)."""
        width = self.length + 1
        out = np.empty((len(starts), width), self.spec.dtype)
        for i, s in enumerate(starts):
            out[i] = self.tokens[s : s + width]
        return out

    def state(self, step: int) -> dict[str, Any]:
        """The data iterator's state before ``step``: where it is, what fixes its order, and the first windows
        it reads next (which a resume compares, so another shuffle, by another grain, cannot pass unseen). JSON."""
        first = step * self.batch
        return {
            "next_step": step,
            "next_example": first,
            "seed": self.seed,
            "windows": self.windows,
            "length": self.length,
            "batch": self.batch,
            "tokens": len(self.tokens),
            "crc32": self.crc32,
            "eval_tokens": len(self.tokens) - self.train_tokens,
            "order": f"grain {grain.__version__} MapDataset.shuffle",
            "next_windows": [self.window_of(first + r) for r in range(min(self.batch, 8))],
        }

    def check_state(self, saved: dict[str, Any], step: int, where: str) -> None:
        """ConfigError unless ``saved`` (a checkpoint's :meth:`state`) continues with this file at ``step``."""
        mine = self.state(step)
        diffs = [
            f"{k} {saved.get(k)!r} (this run: {v!r})" for k, v in mine.items() if k != "order" and saved.get(k) != v
        ]
        if diffs:
            raise ConfigError(
                f"checkpoint {where} was trained on other data than {self._where} gives this run: "
                f"{', '.join(diffs)}; resuming would not continue with its next unseen batch"
            )


def _open(path: Path, dtype: Any, length: int) -> np.ndarray:
    """The token ids of ``path``, memory-mapped; DataError for a file that is not one."""
    where = f"token file {str(path)!r}"
    if not path.exists():
        raise DataError(f"{where} not found")
    if path.is_dir():
        raise DataError(f"{where} is a directory; give a token file ({KNOWN})")
    if not path.is_file():
        raise DataError(
            f"{where} is not a regular file (a device or a pipe cannot be memory-mapped); give a token file ({KNOWN})"
        )
    if path.suffix != ".npy" and dtype is None and path.suffix not in RAW_DTYPES:
        suffix = f"suffix {path.suffix!r}" if path.suffix else "no suffix"
        raise DataError(f"{where} has {suffix}, which says nothing of its format; known: {KNOWN}")
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"{where} is empty (0 bytes); a window needs at least {length + 1} tokens")
    if path.suffix == ".npy":
        try:
            tokens = np.load(path, mmap_mode="r")
        except (ValueError, EOFError, OSError) as e:
            raise DataError(f"{where} is not a readable .npy array: {e}") from None
    else:
        dtype = np.dtype(dtype or RAW_DTYPES[path.suffix])
        if size % dtype.itemsize:
            raise DataError(f"{where} has {size} bytes, not a whole number of {dtype} tokens")
        tokens = np.memmap(path, dtype=dtype, mode="r")
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise DataError(f"{where} holds {tokens.dtype}{list(tokens.shape)}; expected a 1-d array of integer token ids")
    return tokens


def _scan(path: Path, tokens: np.ndarray, vocab: int) -> int:
    """CRC32 of the ids of ``tokens``, read once in chunks; DataError at the first id outside ``[0, vocab)``.

    Compared in the file's own dtype, so a uint64 id of 2**32 or more is reported as it is, not wrapped.
    A file already scanned by this process (same inode, size and mtime) is not read again.
    """
    st = os.stat(path)
    key = (str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, vocab)
    if key in _scanned:
        return _scanned[key]
    crc = 0
    for begin in range(0, len(tokens), CHUNK):
        chunk = np.asarray(tokens[begin : begin + CHUNK])
        bad = np.flatnonzero((chunk < 0) | (chunk >= vocab))
        if bad.size:
            i = int(bad[0])
            value = int(chunk[i])
            kind = f"negative id {value}" if value < 0 else f"id {value}"
            largest = int(np.max(tokens))
            fits = 0 <= value and largest < 2**31  # ids an int32 token batch holds
            fix = f"; pass --set vocab={largest + 1} for a model that reads ids up to {largest}" if fits else ""
            raise DataError(
                f"token file {str(path)!r} holds {kind} at position {begin + i}, "
                f"outside the model's vocab of {vocab} (ids 0 to {vocab - 1}){fix}"
            )
        crc = zlib.crc32(np.ascontiguousarray(chunk).data, crc)
    _scanned[key] = crc
    return crc
