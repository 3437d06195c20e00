"""SIGTERM and Ctrl-C during ``meshdsl train``: the work is saved, the run ends in one line.

A cluster scheduler sends SIGTERM before it preempts a job; a user presses Ctrl-C (SIGINT). Both
reach a run in one of two phases (:class:`Stops`):

- **starting** (building, compiling, restoring: before step 1 runs), there is nothing to save, so
  the run stops at once: one line, the checkpoint dir's lock released, exit ``128 + signal``.
- **training**: the first SIGTERM or SIGINT is a request. The loop finishes the step in progress,
  saves a checkpoint (with ``--checkpoint-dir``), writes its logs, releases the lock and ends with
  one line and exit ``128 + signal`` (:class:`meshdsl.errors.Interrupted`). A second Ctrl-C stops at
  once (a save it cuts short leaves a ``.partial-`` folder, which the next save removes); a repeated
  SIGTERM changes nothing, since a scheduler's SIGKILL follows its grace period anyway.

A signal's Python handler runs only when the main thread runs Python, not while it compiles or waits
for a step; so the handlers only note the signal and a watcher thread, woken through
``signal.set_wakeup_fd``, acts on it at once, ending the process with ``os._exit`` where it stops at
once (which also skips the interpreter's teardown, where JAX's threads could crash it). In a
multi-process run every process asks the others after each step (:meth:`Stops.agreed`), so all stop
after the same step and save one checkpoint together.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def describe(signum: int) -> str:
    """``SIGTERM`` or ``Ctrl-C (SIGINT)``."""
    return "Ctrl-C (SIGINT)" if signum == signal.SIGINT else signal.Signals(signum).name


class Stops:
    """SIGTERM and SIGINT handling for one training run (a context manager; a no-op off the main thread).

    ``err``: where the lines go. ``release``: what a stop at once must undo first (the lock of the
    checkpoint dir). :meth:`training` switches from the starting phase to the training phase;
    :attr:`requested` is the signal asking the loop to stop after its step.
    """

    def __init__(self, err: TextIO = sys.stderr, release: Callable[[], None] | None = None):
        self.err, self.release = err, release
        self.requested: int | None = None
        self.step = 0
        self._training = False
        self._active = threading.current_thread() is threading.main_thread()
        self._pipe: tuple[int, int] | None = None
        self._previous: dict[int, object] = {}
        self._wakeup = -1
        self._watcher: threading.Thread | None = None

    def __enter__(self) -> Stops:
        if not self._active:
            return self
        read, write = os.pipe()
        os.set_blocking(write, False)
        self._pipe = (read, write)
        self._watcher = threading.Thread(target=self._watch, name="meshdsl-signals", daemon=True)
        self._watcher.start()
        self._wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        self._previous = {s: signal.signal(s, _note) for s in SIGNALS}
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        if self._pipe is None:
            return
        for s, handler in self._previous.items():
            signal.signal(s, handler)  # type: ignore[arg-type]
        signal.set_wakeup_fd(self._wakeup)
        os.write(self._pipe[1], b"\0")  # wakes the watcher to end
        assert self._watcher is not None
        self._watcher.join()
        for fd in self._pipe:
            os.close(fd)
        self._pipe = None

    def training(self) -> None:
        """From now on a first SIGTERM or SIGINT asks the loop to stop after the step in progress."""
        self._training = True

    def agreed(self) -> int | None:
        """The signal that stops the run after this step, asked of every process (None: go on)."""
        mine = self.requested or 0
        import jax

        if jax.process_count() > 1:
            import numpy as np
            from jax.experimental import multihost_utils

            mine = int(np.max(multihost_utils.process_allgather(np.int32(mine))))
        return mine or None

    def _watch(self) -> None:
        assert self._pipe is not None
        while True:
            byte = os.read(self._pipe[0], 1)
            if not byte or byte == b"\0":
                return
            self._on(byte[0])

    def _on(self, signum: int) -> None:
        """Act on one signal: note the request, or stop the process at once."""
        if signum not in SIGNALS:
            return
        if not self._training:
            self._now(signum, "before the first step: nothing to save")
        elif self.requested is None:
            self.requested = signum
            self._say(
                f"{describe(signum)}: finishing step {self.step + 1}, then saving and stopping "
                "(Ctrl-C again stops at once)"
            )
        elif signum == signal.SIGINT:
            self._now(signum, f"a second Ctrl-C during step {self.step + 1}: stopped at once, nothing more saved")

    def _now(self, signum: int, why: str) -> None:
        """Release the lock, say one line and end the process with ``128 + signum``."""
        if self.release is not None:
            try:
                self.release()
            except OSError:
                pass
        self._say(f"{describe(signum)}: {why}")
        sys.stdout.flush()
        os._exit(128 + signum)

    def _say(self, line: str) -> None:
        try:
            self.err.write(f"meshdsl train: {line}\n")
            self.err.flush()
        except (OSError, ValueError):
            pass


def _note(signum: int, frame: object) -> None:
    """The Python-level handler: nothing, since the watcher acts on the wakeup byte (a handler must
    be installed, else the default action would end the process)."""
