"""Training settings a layout file may carry in a ``[train]`` table, and the checks of the flags that
watch a run (evaluation, logging, profiling).

A layout TOML file may set the schedule and accumulation beside its mesh and rules::

    [train]
    lr_schedule = "cosine"   # constant, cosine, linear or wsd
    warmup_steps = 20
    min_lr_ratio = 0.1
    learning_rate = 3e-4
    accumulate = 4
    remat = true             # what meshdsl search assumed: the model's remat and compute_dtype
    compute_dtype = "bfloat16"

A flag given on the command line wins over the table; what neither sets takes a resumed
checkpoint's value, else the field's default (:mod:`meshdsl.train.resolve`). Which keys a table may
set is each field's ``table`` (:mod:`meshdsl.train.config`).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from meshdsl.errors import ConfigError, LayoutError
from meshdsl.train import config


def _types(name: str) -> tuple[type, ...]:
    """The TOML types a ``[train]`` key takes: those of its :class:`RunConfig` field."""
    annotation = str(config.settings()[name].type)
    if annotation == "bool":
        return (bool,)
    if "float" in annotation:
        return (int, float)
    return (int,) if "int" in annotation else (str,)


KEYS: dict[str, tuple[type, ...]] = {name: _types(name) for name in config.table_keys()}
"""The keys of a ``[train]`` table (the :class:`RunConfig` fields whose ``Setting.table`` is set) and the
TOML types each takes."""


def train_table(path: Path | None) -> dict[str, Any]:
    """The ``[train]`` table of the layout file ``path`` (empty for inline rules or a file without one).
    LayoutError naming the file for an unknown key or a value of the wrong type."""
    if path is None or not path.is_file():
        return {}
    try:
        table = tomllib.loads(path.read_text()).get("train", {})
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        return {}  # md.Layout.load reports the file itself
    if not isinstance(table, dict):
        raise LayoutError(f"layout file {str(path)!r}: [train] must be a table")
    for key, value in table.items():
        if key not in KEYS:
            raise LayoutError(f"layout file {str(path)!r}: [train] has unknown key {key!r}; known: {', '.join(KEYS)}")
        if (isinstance(value, bool) and bool not in KEYS[key]) or not isinstance(value, KEYS[key]):
            kinds = " or ".join(t.__name__ for t in KEYS[key])
            raise LayoutError(f"layout file {str(path)!r}: [train] {key} = {value!r} should be a {kinds}")
    return dict(table)


def positive(value: Any, flag: str, what: str, zero: bool = False) -> None:
    """ConfigError naming ``flag`` unless ``value`` is a whole number >= 1 (>= 0 with ``zero``)."""
    least = 0 if zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{flag} {value}: {what} is a whole number, {least} or more")


def profile_steps(spec: str, steps: int) -> tuple[int, int]:
    """``"A:B"`` as the steps ``(A, B)`` to trace, both inclusive, within ``1..steps``; ConfigError otherwise."""
    first, colon, last = spec.partition(":")
    try:
        a, b = int(first), int(last if colon else first)
    except ValueError:
        raise ConfigError(
            f"--profile-steps {spec!r}: expected A:B, the first and last step to trace (e.g. 5:7)"
        ) from None
    if not 1 <= a <= b <= steps:
        raise ConfigError(f"--profile-steps {spec}: trace steps A to B with 1 <= A <= B <= --steps {steps}")
    return a, b
