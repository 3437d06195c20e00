"""A run's settings decided and checked once, before anything is built (:func:`settle`).

Each setting of a :class:`~meshdsl.train.config.RunConfig` takes, in order: the value given on
purpose (a flag), else the layout file's ``[train]`` table, else (resuming) the checkpoint's, else
its default. Then, from the fields' own definitions (:class:`~meshdsl.train.config.Setting`):

- each value set by a flag or a layout file is checked (``check``), the error naming where it came
  from (``--learning-rate -0.1`` or ``layout file 'x.toml' [train] learning_rate = -0.1``);
- a setting the run would ignore (its ``needs`` unmet: ``--keep`` without ``--checkpoint-dir``) is
  refused;
- resuming, each setting the checkpoint records is compared (:mod:`meshdsl.train.resume`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from meshdsl.errors import ConfigError
from meshdsl.runtime.layout_spec import layout_path
from meshdsl.train import config, resume, settings
from meshdsl.train.config import RunConfig


@dataclasses.dataclass(frozen=True)
class Settled:
    """A run with every setting decided and checked, and what resuming it starts from."""

    run: RunConfig
    """Every setting decided (``given``: those set by a flag or the layout file)."""
    asked: RunConfig
    """The run as given, before settling (what ``train`` is passed again: settling it once more
    gives the same run and notes)."""
    sources: dict[str, str]
    """Where each setting not at its default came from, as errors name it (``--steps 5``)."""
    checkpoint: Path | None = None
    """The checkpoint a resumed run continues (None: a fresh run)."""
    start: int = 0
    """The step it continues from (0: a fresh run)."""
    notes: tuple[str, ...] = ()
    """One line for each setting the resume took from the checkpoint or changed."""


def settle(run: RunConfig) -> Settled:
    """``run``'s settings decided (flag, layout file, checkpoint, default) and checked; ConfigError
    (LayoutError for a layout file's table) naming the flag or file key for each mistake. Reads the
    layout file and the latest checkpoint's manifest; builds, compiles and writes nothing."""
    values = {name: getattr(run, name) for name in config.settings()}
    sources = {name: _flag_said(name, value) for name, value in values.items() if run.is_given(name)}
    found = _checkpoint(run)
    saved = resume.recorded(found) if found is not None else None
    if saved is not None and "layout" not in sources and "layout" in saved:
        values["layout"] = saved["layout"]
    path = layout_path(values["layout"])
    for key, value in settings.train_table(path).items():
        if key not in sources:
            values[key] = value
            sources[key] = f"layout file {str(path)!r} [train] {key} = {value!r}"
    for name, said in sources.items():
        complaint = config.setting_of(name).check
        problem = complaint(values[name]) if complaint is not None else None
        if problem is not None:
            raise ConfigError(f"{said}: {problem}")
    notes: tuple[str, ...] = ()
    start = 0
    if found is not None and saved is not None:
        notes = resume.merge(found, saved, values, sources)
        start = int(saved["step"])
    for name in sources:
        _check_needed(name, values, sources)
    settled = RunConfig(**values, given=frozenset(sources))
    _check_together(settled, sources, found, start)
    return Settled(settled, run, sources, found, start, notes)


def _flag_said(name: str, value: Any) -> str:
    """How an error names a value given by its flag: ``--steps 5``, ``--remat``."""
    flag = config.flag_of(name)
    return flag if isinstance(value, bool) else f"{flag} {value}"


def _checkpoint(run: RunConfig) -> Path | None:
    """The checkpoint ``run`` resumes (None: a fresh run); ConfigError for a checkpoint dir that
    already holds one when ``run`` does not resume."""
    if run.checkpoint_dir is None:
        return None
    import meshdsl as md  # the package's checkpoint names (train imports no checkpoint module itself)

    found = md.checkpoint.latest(run.checkpoint_dir)
    if found is not None and not run.resume:
        raise ConfigError(
            f"checkpoint dir {run.checkpoint_dir!r} already holds {found.name}; pass --resume to continue that run, "
            "or choose another dir"
        )
    return found


def _check_needed(name: str, values: dict[str, Any], sources: dict[str, str]) -> None:
    """ConfigError when the setting ``name``, set on purpose, would be ignored (its ``needs`` unmet)."""
    needs = config.setting_of(name).needs
    if needs is None or needs.test(values[needs.field]):
        return
    theirs = values[needs.field]
    now = "" if theirs is None or theirs is False else f" (this run's {config.flag_of(needs.field)}: {theirs})"
    raise ConfigError(f"{sources[name]}: the run would ignore it without {needs.words}{now}; drop it or set that too")


def _check_together(run: RunConfig, sources: dict[str, str], found: Path | None, start: int) -> None:
    """The checks that tie settings together: the warmup within the steps, a schedule needing a
    pipeline, a profiled window within the steps this run trains."""
    if "warmup_steps" in sources and run.warmup_steps >= run.steps:
        raise ConfigError(
            f"{sources['warmup_steps']}: warm up over 0 to {run.steps - 1} steps (the run has {run.steps})"
        )
    if run.schedule is not None and "schedule" in sources:
        from meshdsl.runtime.layout_spec import load_layout

        if not load_layout(run.layout).axes_of("layers"):
            raise ConfigError(
                f"--schedule {run.schedule}: layout {run.layout!r} has no pipeline (no rule splits layers over a "
                "stage axis), so there is no schedule to choose"
            )
    if run.profile_steps is not None:
        first, _ = settings.profile_steps(run.profile_steps, run.steps)
        if first <= start:
            raise ConfigError(
                f"--profile-steps {run.profile_steps}: the run resumes from {found} at step {start}, so it trains "
                f"steps {start + 1} to {run.steps}; trace steps within them"
            )
