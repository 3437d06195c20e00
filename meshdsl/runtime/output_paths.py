"""Paths a command will write, checked before any work starts.

A run that trains for an hour and then cannot write its checkpoint or report has lost the hour.
So every command checks the paths it will write (``--checkpoint-dir``, ``--out``,
``--log-json``) first: a directory must be a directory (or be creatable: its nearest existing
ancestor is a writable directory), a file must not be a directory and its directory must be
writable. The checks change nothing, so a run stopped by a later mistake leaves the disk as it
was; the writers create missing parent directories when they first write. Writability is tried,
not guessed from permissions: a directory gets a probe file, created and deleted at once (root
passes every permission check, yet cannot create files in ``/proc`` or on a read-only mount); an
existing file or device gets a write of zero bytes (``/dev/full`` refuses even that).

An output that is also an input (``--data t.npy --log-json t.npy``) is refused: writing it would
destroy the input; so are two outputs at one path (``--log-json X --tensorboard X``, a log named
``run.png`` whose loss curve is ``run.png`` too) and any output inside the checkpoint dir
(:func:`check_apart`). A write that fails once the work has started is a ``WriteError`` saying what
failed and what is intact (:func:`writing`).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

from meshdsl.errors import ConfigError, WriteError


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
    try:
        fd, probe = tempfile.mkstemp(dir=path, prefix=".meshdsl-probe-")
    except OSError as e:
        where = f"{flag} {str(shown)!r}"
        raise ConfigError(f"{where}: no file can be created in directory {str(path)!r} ({e.strerror})") from None
    os.close(fd)
    os.unlink(probe)


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
        _try_write(path, flag)
        return
    _writable_dir(_nearest_existing(path.parent), flag, path)


def _try_write(path: Path, flag: str) -> None:
    """ConfigError unless the existing ``path`` takes a write of zero bytes (which changes nothing)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK)
        try:
            os.write(fd, b"")
        finally:
            os.close(fd)
    except OSError as e:
        raise ConfigError(f"{flag} {str(path)!r} cannot be written: {e.strerror}") from None


def check_not_input(path: str | Path | None, flag: str, inputs: Mapping[str, str | Path | None]) -> None:
    """ConfigError when the output ``path`` is one of ``inputs`` (``{flag: path}``; None: not given):
    writing it would destroy the input."""
    if path is None or not str(path).strip():
        return
    for name, source in inputs.items():
        if source is None or not os.path.exists(source):
            continue
        if os.path.exists(path):
            same = os.path.samefile(path, source)
        else:
            same = Path(path).resolve() == Path(source).resolve()
        if same:
            raise ConfigError(
                f"{flag} {str(path)!r} is also the {name} input; writing it would destroy it, so choose another path"
            )


def _resolved(path: str | Path) -> Path:
    return Path(os.path.abspath(os.path.realpath(path)))


def check_apart(files: Mapping[str, str | Path | None], folders: Mapping[str, str | Path | None], own: str) -> None:
    """ConfigError unless a command's outputs stay out of each other's way: ``files`` and ``folders``
    (``{flag: path}``; None: not given) are what it writes, ``own`` names the folder among ``folders``
    that is the command's alone (``--checkpoint-dir``: nothing else may write inside it, or it would
    overwrite a checkpoint's files). Two outputs at one path are refused (two folders may share one,
    as ``--tensorboard`` and ``--profile-dir`` do), and so is an output inside a file or inside ``own``."""
    given = {**{f: (p, "file") for f, p in files.items() if p}, **{f: (p, "dir") for f, p in folders.items() if p}}
    where = {flag: _resolved(path) for flag, (path, _) in given.items()}
    for flag, (path, kind) in given.items():
        for other, (other_path, other_kind) in given.items():
            if other == flag:
                continue
            shown = f"{flag} {str(path)!r}"
            if where[flag] == where[other] and "file" in (kind, other_kind) and flag < other:
                raise ConfigError(
                    f"{shown} and {other} {str(other_path)!r} are the same path; one would overwrite the other, "
                    "so give them different paths"
                )
            inside = where[flag] == where[other] or where[other] in where[flag].parents
            if other == own and inside:
                raise ConfigError(
                    f"{shown} is inside {own} {str(other_path)!r}, which holds the run's checkpoints alone "
                    "(writing there could overwrite one); choose a path outside it"
                )
            if other_kind == "file" and where[other] in where[flag].parents:
                raise ConfigError(f"{shown} is inside {other} {str(other_path)!r}, which is written as a file")


@contextlib.contextmanager
def writing(what: str, intact: str) -> Iterator[None]:
    """Turn an ``OSError`` in the block (disk full, read-only, a size limit) into a one-line
    WriteError: ``<what> could not be written: <cause>; <intact>``."""
    try:
        yield
    except OSError as e:
        cause = e.strerror or str(e)
        raise WriteError(f"{what} could not be written: {cause}; {intact}") from None


def parent(path: str | Path) -> Path:
    """``path`` after creating its parent directories (what a writer calls just before writing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path
