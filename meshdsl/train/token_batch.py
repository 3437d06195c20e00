"""What a batch read from a token file looks like, read off the model's own ``batch(key)``.

``meshdsl train --data`` fills the model's batch with windows of a token file, so it builds the
batch the model itself builds: the same keys, dims (names and sizes) and dtype. The model's
``batch`` is traced abstractly (``jax.eval_shape``: nothing computed) and its leaves read off.

The rule: the batch is a dict whose values are two integer tensors of one shape ``[rows, positions]``
(rows first: the first dim is the batch dim, the second the position in the window), the inputs
and the next-token targets. Which is which comes from the model's ``TOKEN_KEYS = (inputs_key,
targets_key)`` if it declares one, else from the keys' names: the inputs are called one of
``INPUT_NAMES``, the targets one of ``TARGET_NAMES``. Anything else is a ConfigError saying what
``--data`` needs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import meshdsl as md
from meshdsl.errors import ConfigError, MeshDslError
from meshdsl.lowering.base import GlobalLowering
from meshdsl.lowering.context import use
from meshdsl.model import protocol as model_protocol
from meshdsl.model.protocol import Model

INPUT_NAMES = ("inputs", "input_ids", "tokens", "x")
TARGET_NAMES = ("targets", "labels", "target_ids", "y")
NEEDS = (
    "--data needs a model whose batch(key) returns a dict of two integer [rows, positions] tensors, the "
    f"inputs (a key named {'/'.join(INPUT_NAMES)}) and the targets ({'/'.join(TARGET_NAMES)}), or a Model.TOKEN_KEYS "
    "= (inputs_key, targets_key) naming them"
)


@dataclasses.dataclass(frozen=True)
class TokenBatch:
    """The keys, dims and dtype of a token batch: ``{inputs: [rows, positions], targets: [rows, positions]}``."""

    rows: md.Dim
    positions: md.Dim
    inputs: str = "inputs"
    targets: str = "targets"
    dtype: Any = np.int32

    @property
    def shape(self) -> md.Shape:
        return md.Shape([self.rows, self.positions])


def token_batch_of(model: Model, what: str) -> TokenBatch:
    """The :class:`TokenBatch` of ``model``'s own ``batch(key)`` (see the module docstring for the rule);
    ConfigError naming what ``--data`` needs when the batch has no such pair, ``what`` its first words
    (``"--data 'tokens.npy': model llama.py"``)."""
    try:
        with use(GlobalLowering()):
            batch = jax.eval_shape(model.batch, jax.ShapeDtypeStruct((2,), jnp.uint32))
    except MeshDslError:
        raise
    except Exception as e:
        raise ConfigError(f"{what}: batch(key) failed while reading its keys: {type(e).__name__}: {e}") from None
    if not isinstance(batch, dict) or not all(isinstance(v, md.Tensor) for v in batch.values()):
        raise ConfigError(f"{what} reads no token sequences: its batch(key) returns {_describe(batch)}; {NEEDS}")
    shown = ", ".join(f"{k}: {v.shape} {v.dtype}" for k, v in batch.items())
    inputs, targets = _pair(model, batch, what, shown)
    x, y = batch[inputs], batch[targets]
    for key, t in ((inputs, x), (targets, y)):
        if len(t.shape) != 2 or not jnp.issubdtype(t.dtype, jnp.integer):
            raise ConfigError(
                f"{what} reads no token sequences: its batch key {key!r} is {t.shape} {t.dtype}, "
                f"not integer [rows, positions]; {NEEDS}"
            )
    if x.shape != y.shape or x.dtype != y.dtype:
        raise ConfigError(
            f"{what}: its inputs {inputs!r} ({x.shape} {x.dtype}) and targets {targets!r} "
            f"({y.shape} {y.dtype}) differ; {NEEDS}"
        )
    others = [k for k in batch if k not in (inputs, targets)]
    if others:
        raise ConfigError(
            f"{what}: its batch has keys {', '.join(map(repr, others))} besides the token windows "
            f"{inputs!r} and {targets!r}, which a token file cannot fill ({shown})"
        )
    rows, positions = x.shape
    return TokenBatch(rows, positions, inputs, targets, np.dtype(x.dtype))


def _pair(model: Model, batch: dict[str, md.Tensor], what: str, shown: str) -> tuple[str, str]:
    """The inputs' and targets' keys: the model's ``TOKEN_KEYS``, else the keys' names."""
    declared = model_protocol.token_keys(model)
    if declared is not None:
        if not (isinstance(declared, (tuple, list)) and len(declared) == 2 and all(k in batch for k in declared)):
            raise ConfigError(
                f"{what}: its TOKEN_KEYS = {declared!r} must be (inputs_key, targets_key), "
                f"two keys of its batch ({shown})"
            )
        return declared[0], declared[1]
    inputs = [k for k in batch if k in INPUT_NAMES]
    targets = [k for k in batch if k in TARGET_NAMES]
    if len(inputs) != 1 or len(targets) != 1:
        raise ConfigError(f"{what} reads no token sequences: its batch is {{{shown}}}; {NEEDS}")
    return inputs[0], targets[0]


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return "a dict of " + ", ".join(f"{k}: {type(v).__name__}" for k, v in value.items())
    return f"a {type(value).__name__}"
