"""How to pipeline: :class:`PipelineConfig` (microbatches, schedule, virtual stages), a layout's ``[pipeline]`` table.

Its own module, which needs nothing else of meshdsl's, so that :mod:`meshdsl.layout` (which holds a
layout's pipeline settings) and :mod:`meshdsl.pipeline` (which runs them) both import it without
importing each other. ``md.pipeline.PipelineConfig`` and ``md.pipeline.SCHEDULES`` are these.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from meshdsl.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved")
KEYS = ("microbatches", "schedule", "virtual_stages")


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """How to pipeline: ``microbatches`` per step, the ``schedule`` (``gpipe``, ``1f1b`` or ``interleaved``)
    and, for ``interleaved``, ``virtual_stages``: the chunks of layers each device holds (Megatron's ``v``)."""

    microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1

    def __post_init__(self) -> None:
        for name in ("microbatches", "virtual_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"pipeline {name} must be a positive integer, got {value!r}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"pipeline schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.virtual_stages != 1 and self.schedule != "interleaved":
            raise ConfigError(
                f"pipeline virtual_stages = {self.virtual_stages} needs schedule 'interleaved', not {self.schedule!r}"
            )

    @classmethod
    def of(cls, table: PipelineConfig | Mapping[str, Any] | None) -> PipelineConfig:
        """From a layout file's ``[pipeline]`` table (``microbatches``, ``schedule``, ``virtual_stages``), or the
        default."""
        if table is None or isinstance(table, PipelineConfig):
            return table or cls()
        unknown = set(table) - set(KEYS)
        if unknown:
            raise ConfigError(f"[pipeline] has unknown key(s) {sorted(unknown)}; expected {', '.join(KEYS)}")
        return cls(**table)

    def replace(
        self, microbatches: int | None = None, schedule: str | None = None, virtual_stages: int | None = None
    ) -> PipelineConfig:
        """These settings with the given ones (None: kept) replaced, as command-line flags do. A new schedule
        other than ``interleaved`` drops the virtual stages (1) unless they are given."""
        schedule = schedule or self.schedule
        if virtual_stages is None:
            virtual_stages = self.virtual_stages if schedule == "interleaved" else 1
        return PipelineConfig(self.microbatches if microbatches is None else microbatches, schedule, virtual_stages)
