"""What a checkpoint records about its run, and what resuming does with each setting, in one place.

A checkpoint's metadata records every setting whose :class:`~meshdsl.train.config.Resume` is MATCH
or CHANGE (:func:`record`), beside the model's whole config and the step. Resuming
(:func:`merge`, called by :func:`meshdsl.train.resolve.settle`), each recorded setting:

- not given (by a flag or the layout file): takes the checkpoint's value, said in one line
  (``--resume: learning rate 0.5 from the checkpoint``) when it differs from the default;
- given the same: nothing to say;
- given differently: CHANGE settings (``--steps``, ``--eval-every``, the layout) are applied and said;
  MATCH settings (the model, optimizer, learning rate and schedule, seed, data) are a ConfigError:
  the run would not continue as it was. ``--seed`` is MATCH because the resumed run reads the
  checkpoint's data stream while evaluation would draw the new seed's set; so is ``--steps`` under a
  decaying schedule, whose rate at each step depends on the run's length.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from meshdsl.errors import ConfigError, DataError
from meshdsl.model.protocol import Model
from meshdsl.train import config
from meshdsl.train.config import Resume, RunConfig

RESUMABLE_CHANGES = ("remat", "remat_policy", "loss_chunk")
"""Model config fields a resumed run may change: what is recomputed or chunked, not what is computed."""


def recorded_names() -> tuple[str, ...]:
    """The settings a checkpoint records (MATCH and CHANGE)."""
    return tuple(n for n in config.settings() if config.setting_of(n).resume is not Resume.OWN)


def record(run: RunConfig, model: Model) -> dict[str, Any]:
    """What a checkpoint records about the run beside its state: each recorded setting and the model's config."""
    return {
        **{name: getattr(run, name) for name in recorded_names()},
        "config": config_of(model),
    }


def config_of(model: Model) -> dict[str, Any]:
    """``model``'s config as a checkpoint records it (JSON values)."""
    found: dict[str, Any] = json.loads(json.dumps(dataclasses.asdict(model.config)))
    return found


def recorded(found: Path) -> dict[str, Any]:
    """The settings the checkpoint ``found`` records (an older checkpoint's schedule record read as
    settings); DataError for one not saved by ``meshdsl train`` or renamed."""
    import meshdsl as md  # the package's checkpoint names (train imports no checkpoint module itself)

    saved = dict(md.checkpoint.read_manifest(found)["metadata"])
    if not isinstance(saved.get("step"), int):
        raise DataError(
            f"checkpoint {found} records no training step in its metadata; it was not saved by meshdsl train"
        )
    if found.name != f"step_{saved['step']}":
        raise DataError(
            f"checkpoint {found} records step {saved['step']} in its manifest, not the {found.name} of its name; was "
            f"step_{saved['step']} renamed? Rename it back or remove it"
        )
    old = saved.get("lr_schedule")
    if isinstance(old, dict):  # before each setting was recorded on its own
        saved["lr_schedule"] = old.get("kind")
        for key in ("warmup_steps", "min_lr_ratio", "steps"):
            if old.get(key) is not None:
                saved[key] = old[key]
    return saved


def _words(name: str) -> str:
    return name.replace("_", " ")


def merge(found: Path, saved: dict[str, Any], values: dict[str, Any], sources: dict[str, str]) -> tuple[str, ...]:
    """Take each recorded setting that ``sources`` (those set on purpose) lacks from ``saved`` into
    ``values``; ConfigError for a MATCH setting set differently. The lines that say what was taken or changed."""
    notes = []
    # --init-from-hf first: it also sets the model (hf:DIR), and a mismatch is best named by the flag given
    for name in sorted(recorded_names(), key=lambda n: n != "init_from_hf"):
        if name not in saved:
            continue
        theirs, mine = saved[name], values[name]
        if name not in sources:
            values[name] = theirs
            if theirs != config.default_of(name):
                notes.append(f"--resume: {_words(name)} {theirs} from the checkpoint")
        elif theirs != mine:
            if config.setting_of(name).resume is Resume.MATCH:
                raise ConfigError(
                    f"{sources[name]}: checkpoint {found} was trained with {_words(name)} {theirs}, and resuming "
                    f"with another would not continue that run; drop {config.flag_of(name)} to continue it"
                )
            notes.append(f"--resume: {_words(name)} {mine} (the checkpoint's: {theirs})")
    steps = saved.get("steps")
    if (
        values["lr_schedule"] in config.DECAYING
        and "steps" in sources
        and steps is not None
        and steps != values["steps"]
    ):
        raise ConfigError(
            f"{sources['steps']}: checkpoint {found} was trained under the {values['lr_schedule']} learning-rate "
            f"schedule over {steps} steps, so its rate would not continue as it was; drop --steps to continue it"
        )
    if saved["step"] > values["steps"]:
        raise ConfigError(
            f"checkpoint {found} is at step {saved['step']}, past --steps {values['steps']}; pass --steps "
            f"{saved['step'] + 1} or more to continue"
        )
    return tuple(notes)


def check_config(found: Path, saved: dict[str, Any], mine: dict[str, Any], name: str) -> None:
    """ConfigError unless the config ``mine`` (:func:`config_of` the model ``name``) is the one the checkpoint
    ``found`` (its metadata: ``saved``) was saved with, bar RESUMABLE_CHANGES."""
    theirs = saved.get("config") or {}
    diffs = [
        f"{k}={theirs.get(k)!r} (this run: {v!r})"
        for k, v in mine.items()
        if k not in RESUMABLE_CHANGES and theirs.get(k) != v
    ]
    if diffs:
        raise ConfigError(f"checkpoint {found} was saved with a different {name} config: {', '.join(diffs)}")
