"""How to pipeline: :class:`PipelineConfig` (microbatches and schedule), a layout's ``[pipeline]`` table.

Its own module, which needs nothing else of meshdsl's, so that :mod:`meshdsl.layout` (which holds a
layout's pipeline settings) and :mod:`meshdsl.pipeline` (which runs them) both import it without
importing each other. ``md.pipeline.PipelineConfig`` and ``md.pipeline.SCHEDULES`` are these.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from meshdsl.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b")


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """How to pipeline: ``microbatches`` per step and the ``schedule`` (``gpipe`` or ``1f1b``)."""

    microbatches: int = 1
    schedule: str = "1f1b"

    def __post_init__(self) -> None:
        if not isinstance(self.microbatches, int) or isinstance(self.microbatches, bool) or self.microbatches < 1:
            raise ConfigError(f"pipeline microbatches must be a positive integer, got {self.microbatches!r}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"pipeline schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")

    @classmethod
    def of(cls, table: "PipelineConfig | Mapping[str, Any] | None") -> "PipelineConfig":
        """From a layout file's ``[pipeline]`` table (``microbatches``, ``schedule``), or the default."""
        if table is None or isinstance(table, PipelineConfig):
            return table or cls()
        unknown = set(table) - {"microbatches", "schedule"}
        if unknown:
            raise ConfigError(f"[pipeline] has unknown key(s) {sorted(unknown)}; expected microbatches, schedule")
        return cls(**table)

    def replace(self, microbatches: int | None = None, schedule: str | None = None) -> "PipelineConfig":
        """These settings with the given ones (None: kept) replaced, as command-line flags do."""
        return PipelineConfig(self.microbatches if microbatches is None else microbatches, schedule or self.schedule)
