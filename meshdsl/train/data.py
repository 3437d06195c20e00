"""Token data from a file, read by memory map; each process reads only the rows it owns.

A token file is a ``.npy`` array of token ids, or raw little-endian ``uint16`` / ``uint32``
(``.bin``, ``.u16``, ``.u32``: pass ``dtype`` for other names; any other suffix is a DataError,
not a guess). Step ``s`` reads, for batch row
``r``, the window of ``length + 1`` tokens starting at ``((s * batch + r) * length) mod
(tokens - length - 1)``: inputs are its first ``length`` tokens, targets its last ``length``.

The batch arrays are built with ``jax.make_array_from_callback``: JAX asks each process only for
the blocks its own devices hold, and the callback reads only those rows from the map.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np

import meshdsl as md
from meshdsl.errors import DataError

RAW_DTYPES = {".bin": np.uint16, ".u16": np.uint16, ".u32": np.uint32}
KNOWN = ".npy (a numpy array), .bin or .u16 (raw uint16), .u32 (raw uint32)"
"""The suffixes a token file may have (another name needs ``dtype``)."""


class TokenFile:
    """Batches of ``[batch, length]`` inputs and targets from a token file."""

    def __init__(self, path: str | Path, batch: int, length: int, vocab: int, dtype: Any = None):
        self.path = Path(path)
        where = f"token file {str(self.path)!r}"
        if not self.path.exists():
            raise DataError(f"{where} not found")
        if self.path.is_dir():
            raise DataError(f"{where} is a directory; give a token file ({KNOWN})")
        if not self.path.is_file():
            raise DataError(f"{where} is not a regular file (a device or a pipe cannot be memory-mapped); give a token file ({KNOWN})")
        if self.path.suffix != ".npy" and dtype is None and self.path.suffix not in RAW_DTYPES:
            raise DataError(f"{where} has {f'suffix {self.path.suffix!r}' if self.path.suffix else 'no suffix'}, which says nothing of its format; known: {KNOWN}")
        size = self.path.stat().st_size
        if size == 0:
            raise DataError(f"{where} is empty (0 bytes); a window needs at least {length + 2} tokens")
        if self.path.suffix == ".npy":
            try:
                self.tokens = np.load(self.path, mmap_mode="r")
            except (ValueError, EOFError, OSError) as e:
                raise DataError(f"{where} is not a readable .npy array: {e}") from None
        else:
            dtype = np.dtype(dtype or RAW_DTYPES[self.path.suffix])
            if size % dtype.itemsize:
                raise DataError(f"{where} has {size} bytes, not a whole number of {dtype} tokens")
            self.tokens = np.memmap(self.path, dtype=dtype, mode="r")
        if self.tokens.ndim != 1 or not np.issubdtype(self.tokens.dtype, np.integer):
            raise DataError(f"token file {str(self.path)!r} holds {self.tokens.dtype}{list(self.tokens.shape)}; expected a 1-d array of integer token ids")
        if len(self.tokens) < length + 2:
            raise DataError(f"token file {str(self.path)!r} has {len(self.tokens)} tokens; a window needs at least {length + 2}")
        self.batch, self.length, self.vocab = batch, length, vocab
        self.batch_dim, self.length_dim = md.Dim("batch", batch), md.Dim("length", length)

    def _rows(self, step: int, rows: range, shift: int) -> np.ndarray:
        starts = ((step * self.batch + np.asarray(rows)) * self.length) % (len(self.tokens) - self.length - 1)
        out = np.stack([np.asarray(self.tokens[s + shift : s + shift + self.length]) for s in starts]).astype(np.int32)
        if out.size and (out.max() >= self.vocab or out.min() < 0):
            raise DataError(f"token file {str(self.path)!r} holds id {int(out.max())}, outside the model's vocab of {self.vocab}")
        return out

    def batch_at(self, step: int, mesh: md.Mesh, layout: md.Layout) -> dict[str, md.Tensor]:
        """The batch of ``step``, laid out on ``mesh`` as ``layout`` says for ``[batch, length]``."""
        shape = md.Shape([self.batch_dim, self.length_dim])
        sharding = layout.sharding(mesh, shape)

        def make(shift: int) -> md.Tensor:
            def block(index: tuple) -> np.ndarray:
                rows = range(*index[0].indices(self.batch))
                return self._rows(step, rows, shift)[:, index[1]]

            return md.Tensor(jax.make_array_from_callback(shape.sizes, sharding, block), shape)

        return {"inputs": make(0), "targets": make(1)}
