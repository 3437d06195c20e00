"""Named model configurations: ``Config.preset("tiny", batch=4)``."""

from __future__ import annotations

from typing import Any, ClassVar

from meshdsl.errors import ConfigError


class Presets:
    """Mixin for a model's ``Config`` dataclass: ``PRESETS`` maps a name to field values."""

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {}

    @classmethod
    def preset(cls, name: str, **overrides: Any):
        """The preset ``name`` with ``overrides`` applied."""
        if name not in cls.PRESETS:
            model = cls.__module__.split(".")[-1]
            raise ConfigError(f"unknown preset {name!r} for {model}; choose one of {', '.join(cls.PRESETS)}")
        return cls(**{**cls.PRESETS[name], **overrides})
