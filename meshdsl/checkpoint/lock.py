"""One run at a time in a checkpoint directory.

Two trainers saving into one directory delete each other's unfinished saves and replace each
other's checkpoints. So a run locks the directory: the file ``<dir>/.meshdsl-lock`` names its
host and pid, and the run holds an exclusive ``flock`` on it while it lives. The kernel drops
that lock when the process ends however it ends, so a lock left by a dead process on this host
is taken over (the caller gets a note naming it); one held by a live process refuses the second
run. A lock file naming another host whose lock is free cannot be judged from here (a network
file system without working locks): it refuses, saying which file to delete.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from meshdsl.errors import ConfigError

LOCK = ".meshdsl-lock"


def _owner(text: str) -> dict:
    """The host, pid and start time a lock file records (an empty dict when unreadable)."""
    try:
        owner = json.loads(text)
    except ValueError:
        return {}
    return owner if isinstance(owner, dict) else {}


def _who(owner: dict) -> str:
    return f"process {owner.get('pid', '?')} on host {owner.get('host', '?')}, since {owner.get('started', '?')}"


class DirLock:
    """The lock of one directory; :meth:`acquire` takes it, :meth:`release` gives it back."""

    def __init__(self, directory: str | Path, flag: str = "checkpoint dir"):
        self.directory, self.flag = Path(directory), flag
        self.fd: int | None = None
        self.created_dir = False

    @property
    def path(self) -> Path:
        return self.directory / LOCK

    def acquire(self) -> str | None:
        """Take the lock (creating the directory if needed); a note when it took over a dead run's
        lock, else None. ConfigError, changing nothing, when another run holds it."""
        if self.fd is not None:
            return None
        try:
            return self._acquire()
        except OSError as e:
            self._undo_dir()
            where = str(self.directory)
            raise ConfigError(f"{self.flag} {where!r}: cannot write its lock file {LOCK}: {e.strerror}") from None

    def _acquire(self) -> str | None:
        if not self.directory.is_dir():
            self.directory.mkdir(parents=True)
            self.created_dir = True
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _owner(os.read(fd, 4096).decode(errors="replace"))
                os.close(fd)
                self._undo_dir()
                raise ConfigError(
                    f"{self.flag} {str(self.directory)!r} is in use by another run ({_who(owner)}); "
                    "wait for it to finish or choose another directory"
                ) from None
            if os.path.exists(self.path) and os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                break
            os.close(fd)  # the holder deleted the file between our open and our flock: try again
        try:
            return self._claim(fd)
        except ConfigError:
            os.close(fd)
            self._undo_dir()
            raise

    def _claim(self, fd: int) -> str | None:
        """Write this process into the locked file ``fd``; the note on a dead run's lock."""
        previous = _owner(os.pread(fd, 4096, 0).decode(errors="replace"))
        host = socket.gethostname()
        if previous and previous.get("host") != host:
            raise ConfigError(
                f"{self.flag} {str(self.directory)!r} is locked by {_who(previous)}, which this host cannot check; "
                f"if that run has ended, delete {str(self.path)!r}"
            )
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        me = json.dumps({"host": host, "pid": os.getpid(), "started": started})
        os.ftruncate(fd, 0)
        os.pwrite(fd, me.encode(), 0)
        self.fd = fd
        if previous and previous.get("pid") != os.getpid():
            where = str(self.directory)
            return f"took over the lock of {where!r} left by process {previous.get('pid')}, which no longer runs"
        return None

    def release(self) -> None:
        """Give the lock back: delete the lock file (and the directory, if this lock made it and it is empty)."""
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = None
        self._undo_dir()

    def _undo_dir(self) -> None:
        if self.created_dir:
            try:
                self.directory.rmdir()
            except OSError:
                pass
            self.created_dir = False
