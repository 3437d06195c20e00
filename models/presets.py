"""Named model configurations: ``Config.preset("tiny", batch=4)``."""

from __future__ import annotations

from typing import Any, ClassVar


class Presets:
    """Mixin for a shipped model's ``Config`` dataclass: ``PRESETS`` maps a name to field values.

    A convenience for Python code; a model needs only ``PRESETS`` (no base class), which
    :func:`meshdsl.model.config.configure` reads for every command.
    """

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {}

    @classmethod
    def preset(cls, name: str, **overrides: Any):
        """The preset ``name`` with ``overrides`` applied (checked as ``--set`` values are)."""
        from meshdsl.model.config import configure

        return configure(cls, name, overrides, cls.__module__.split(".")[-1])
