"""Padded fine-tuning examples from an ``.npz``: shuffled and resumable as token files are.

The file holds ``input_ids [N, T]`` (integer ids in ``[0, vocab)``) and, optionally, ``labels [N, T]``
(ids, or ``-100`` where no loss is taken: prompts, padding; transformers' convention) or
``attention_mask [N, T]`` (0 where padded, which then makes those labels ``-100``); without either,
the labels are the ids. As in transformers, label ``t`` is the target of the prediction made at
position ``t - 1``: a step's inputs are ``input_ids[:, :length]`` and its targets
``labels[:, 1 : length + 1]``, an example shorter than ``length + 1`` padded with ids 0 and targets
``-100`` (so ``T - 1`` is the model's natural ``length``; a longer example is a DataError, not cut).

Every example must keep at least one target (a batch of ignored targets would have no loss to
average): checked, with the ids and labels, when the file is opened. The last ``eval_fraction`` of
the examples is held out; training visits the rest in grain's seeded shuffle, as
:class:`meshdsl.train.data.TokenFile` visits windows, so a resumed run reads the batches an
uninterrupted one reads, and :meth:`ExampleFile.state` lets the resume check it.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np

import meshdsl as md
from meshdsl.errors import ConfigError, DataError
from meshdsl.train.data import EVAL_FRACTION, TokenFile
from meshdsl.train.token_batch import TokenBatch

IGNORE = -100
"""The label transformers' loss (and the shipped decoders') leaves out."""


class ExampleFile(TokenFile):
    """Batches of the model's inputs and targets (keys and dims of ``spec``) from an ``.npz`` of padded examples."""

    def __init__(
        self,
        path: str | Path,
        spec: TokenBatch,
        vocab: int,
        *,
        seed: int = 0,
        eval_fraction: float = EVAL_FRACTION,
    ):
        self._settle(path, spec, vocab, eval_fraction)
        if np.iinfo(spec.dtype).min > IGNORE:
            raise ConfigError(f"the model's token dtype {np.dtype(spec.dtype)} cannot hold the label {IGNORE}")
        self.inputs, self.targets = _read(self.path, self.length, vocab, spec.dtype)
        n = len(self.inputs)
        self.windows = n - int(eval_fraction * n)
        """Training examples: the ones before the held-out tail."""
        self.eval_windows = n - self.windows
        if self.windows < 1:
            raise DataError(f"{self._where} has {n} examples, none before the held-out tail (--eval-fraction)")
        self.crc32 = zlib.crc32(self.targets.tobytes(), zlib.crc32(self.inputs.tobytes()))
        self.seed = seed % 2**32
        self.order = grain.MapDataset.range(self.windows).shuffle(seed=self.seed)

    @property
    def _where(self) -> str:
        return f"examples file {str(self.path)!r}"

    def batch_at(self, step: int, mesh: md.Mesh, layout: md.Layout) -> dict[str, md.Tensor]:
        return self._batch(lambda r: self.window_of(step * self.batch + r), mesh, layout)

    def eval_batch_at(self, index: int, mesh: md.Mesh, layout: md.Layout) -> dict[str, md.Tensor]:
        """Held-out batch ``index``: the tail's examples in file order (cycling); DataError when there are none."""
        if self.eval_windows < 1:
            raise DataError(f"{self._where}: no example is held out; pass a larger --eval-fraction")
        first = index * self.batch
        return self._batch(lambda r: self.windows + (first + r) % self.eval_windows, mesh, layout)

    def _batch(self, example_of: Any, mesh: md.Mesh, layout: md.Layout) -> dict[str, md.Tensor]:
        """Inputs and targets of examples ``example_of(row)``: each device block reads only its rows."""
        shape = self.spec.shape
        sharding = layout.sharding(mesh, shape)

        def make(table: np.ndarray) -> md.Tensor:
            def block(index: tuple[slice, ...] | None) -> np.ndarray:
                assert index is not None  # typed optional by JAX, which asserts it is not None before each call
                rows = range(*index[0].indices(self.batch))
                return table[[example_of(r) for r in rows]][:, index[1]]

            return md.Tensor(jax.make_array_from_callback(shape.sizes, sharding, block), shape)

        return {self.spec.inputs: make(self.inputs), self.spec.targets: make(self.targets)}

    def state(self, step: int) -> dict[str, Any]:
        """The iterator's state before ``step`` (see :meth:`TokenFile.state`). JSON."""
        first = step * self.batch
        return {
            "next_step": step,
            "next_example": first,
            "seed": self.seed,
            "examples": self.windows,
            "length": self.length,
            "batch": self.batch,
            "crc32": self.crc32,
            "eval_examples": self.eval_windows,
            "order": f"grain {grain.__version__} MapDataset.shuffle",
            "next_examples": [self.window_of(first + r) for r in range(min(self.batch, 8))],
        }


def _read(path: Path, length: int, vocab: int, dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    """The inputs and targets ``[N, length]`` of the examples in ``path``; DataError for a file that is not such."""
    where = f"examples file {str(path)!r}"
    if not path.is_file():
        raise DataError(f"{where} not found")
    try:
        with np.load(path) as data:
            arrays = {k: np.asarray(data[k]) for k in data.files}
    except (ValueError, OSError, EOFError) as e:
        raise DataError(f"{where} is not a readable .npz: {e}") from None
    unknown = sorted(set(arrays) - {"input_ids", "labels", "attention_mask"})
    if "input_ids" not in arrays or unknown:
        raise DataError(
            f"{where} holds {sorted(arrays)}; it needs input_ids [N, T] and may hold labels, attention_mask"
        )
    ids = arrays["input_ids"]
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer) or ids.shape[0] < 1 or ids.shape[1] < 2:
        raise DataError(f"{where}: input_ids is {ids.dtype}{list(ids.shape)}; it must be integers [N, T], T >= 2")
    for key in ("labels", "attention_mask"):
        if key in arrays and (arrays[key].shape != ids.shape or not np.issubdtype(arrays[key].dtype, np.integer)):
            raise DataError(
                f"{where}: {key} is {arrays[key].dtype}{list(arrays[key].shape)}, not integers {list(ids.shape)}"
            )
    if ids.shape[1] - 1 > length:
        raise DataError(
            f"{where}: examples of {ids.shape[1]} tokens are longer than length + 1 = {length + 1}; "
            f"set length={ids.shape[1] - 1}"
        )
    _check_ids(ids, vocab, f"{where}: input_ids")
    labels = arrays.get("labels", ids)
    if "attention_mask" in arrays:
        labels = np.where(arrays["attention_mask"] == 0, IGNORE, labels)
    _check_ids(np.where(labels == IGNORE, 0, labels), vocab, f"{where}: labels (other than {IGNORE})")
    n, pad = len(ids), length + 1 - ids.shape[1]
    inputs = np.pad(ids, ((0, 0), (0, pad)))[:, :length].astype(dtype)
    targets = np.pad(labels, ((0, 0), (0, pad)), constant_values=IGNORE)[:, 1:].astype(dtype)
    empty = np.flatnonzero((targets == IGNORE).all(axis=1))
    if empty.size:
        raise DataError(
            f"{where}: example {int(empty[0])} (of {n}) has no label other than {IGNORE} after its first "
            "token: it would add nothing to the loss (and a batch of such has no loss); drop it"
        )
    return inputs, targets


def _check_ids(ids: np.ndarray, vocab: int, what: str) -> None:
    """DataError at the first id outside ``[0, vocab)``."""
    bad = np.argwhere((ids < 0) | (ids >= vocab))
    if bad.size:
        row, col = (int(i) for i in bad[0])
        raise DataError(f"{what} hold id {int(ids[row, col])} at [{row}, {col}], outside the vocab of {vocab}")
