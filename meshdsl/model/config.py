"""A model's ``Config`` at a preset with fields overridden, checked: what ``--preset`` and ``--set`` mean.

Apart from :mod:`meshdsl.model.loader` (which finds and imports model modules) so that a model module can
use it (``Config.preset(...)`` of :mod:`meshdsl.models.presets`) without importing the loader, which
imports the model modules.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from meshdsl.errors import ConfigError
from meshdsl.model.user import error_text, location


def configure(config_class: Any, preset: str, overrides: dict[str, Any], model: str, mine: Sequence[Path] = ()) -> Any:
    """``config_class`` at the preset ``preset`` with ``overrides``.

    ConfigError for an unknown preset (naming the presets), an unknown field (naming the fields),
    or a value unlike the field's (its default, else the preset's value), in ``overrides`` or in the
    preset itself: integer fields (sizes, counts) take integers of at least 1, float fields finite
    numbers of at least 0, other fields values of that value's type; and for a config that rejects the
    values (its ``__post_init__``), naming the line of ``mine`` (the user's files or folders) that raised.
    """
    presets = config_class.PRESETS
    if preset not in presets:
        raise ConfigError(f"unknown preset {preset!r} for {model}; choose one of {', '.join(presets)}")
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    unknown = [k for k in overrides if k not in fields]
    if unknown:
        raise ConfigError(f"model {model} has no option {', '.join(unknown)}; its fields are {', '.join(fields)}")
    values = {**presets[preset], **overrides}
    for name, value in overrides.items():
        reference = _default(fields[name])
        reference = presets[preset].get(name, reference) if reference is dataclasses.MISSING else reference
        if reference is not dataclasses.MISSING:
            _check_field(model, name, value, reference)
    for name, value in presets[preset].items():  # a preset's own sizes too: a 0 would train on empty tensors
        reference = _default(fields[name]) if name in fields and name not in overrides else None
        if reference is not None and reference is not dataclasses.MISSING:
            _check_field(f"{model} preset {preset}", name, value, reference)
    try:
        return config_class(**values)
    except ConfigError:
        raise
    except Exception as e:
        where = location(e, mine)
        at = f" at {where}" if where else ""
        raise ConfigError(
            f"model {model} preset {preset}: {config_class.__name__}({_show(values)}) failed{at}: {error_text(e)}"
        ) from None


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _show(values: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in values.items())


def _check_field(model: str, field: str, value: Any, reference: Any) -> None:
    """ConfigError unless ``value`` suits a config field whose preset or default value is ``reference``."""
    if isinstance(reference, bool) or not isinstance(reference, (int, float)):
        if not isinstance(value, type(reference)):
            raise ConfigError(
                f"model {model}: {field}={value!r}, "
                f"but {field} takes a {type(reference).__name__} such as {reference!r}"
            )
    elif isinstance(reference, int):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"model {model}: {field}={value!r}, but {field} takes an integer of at least 1")
    elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"model {model}: {field}={value!r}, but {field} takes a finite number of at least 0")
