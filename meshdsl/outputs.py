"""Paths a command will write, checked before any work starts.

A run that trains for an hour and then cannot write its checkpoint or report has lost the hour.
So every command checks the paths it will write (``--checkpoint-dir``, ``--out``,
``--log-json``) first: a directory must be a directory (or be creatable: its nearest existing
ancestor is a writable directory), a file must not be a directory and its directory must be
writable. The checks create and change nothing, so a run stopped by a later mistake leaves the
disk as it was; the writers create missing parent directories when they first write.
"""

from __future__ import annotations

import os
from pathlib import Path

from meshdsl.errors import ConfigError


def _nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists (``.`` for a relative path's base)."""
    for candidate in (path, *path.parents):
        if os.path.lexists(candidate):
            return candidate
    return Path(".")


def _writable_dir(path: Path, flag: str, shown: Path) -> None:
    """ConfigError unless the existing ``path`` is a directory this process may create files in."""
    if not path.is_dir():
        what = "a file" if path.is_file() else "not a directory"
        raise ConfigError(f"{flag} {str(shown)!r}: {str(path)!r} is {what}, so the directory cannot be created")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {str(shown)!r}: directory {str(path)!r} is not writable")


def check_dir(path: str | Path, flag: str) -> None:
    """ConfigError (one line, naming ``flag``) unless ``path`` is, or can be created as, a writable directory."""
    if not str(path).strip():
        raise ConfigError(f"{flag} is empty: give a directory")
    path = Path(path)
    _writable_dir(_nearest_existing(path), flag, path)


def check_file(path: str | Path, flag: str) -> None:
    """ConfigError (one line, naming ``flag``) unless ``path`` can be written as a file.

    An existing file (or device, such as ``/dev/null``) must be writable: it will be replaced; a
    missing one needs a directory that exists or can be created. Nothing is created or truncated here.
    """
    if not str(path).strip():
        raise ConfigError(f"{flag} is empty: give a file name")
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{flag} {str(path)!r} is a directory; give a file name")
    if os.path.lexists(path):
        if not os.access(path, os.W_OK):
            raise ConfigError(f"{flag} {str(path)!r} is not writable")
        return
    _writable_dir(_nearest_existing(path.parent), flag, path)


def parent(path: str | Path) -> Path:
    """``path`` after creating its parent directories (what a writer calls just before writing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path
