"""Models written only in meshdsl ops. Each module has a ``Config`` with presets and a ``Model``.

A model is layout-free: the same code runs under every layout. ``get(name)`` returns a module.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from meshdsl.errors import ConfigError

NAMES = ("mlp", "transformer", "moe", "convnet")


def get(name: str) -> ModuleType:
    """The model module called ``name``."""
    if name not in NAMES:
        raise ConfigError(f"unknown model {name!r}; choose one of {', '.join(NAMES)}")
    return importlib.import_module(f"models.{name}")
