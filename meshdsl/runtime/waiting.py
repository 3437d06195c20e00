"""Progress lines for a long wait whose count is known (search's candidates, bench's entries and
rounds, calibration's probes): ``meshdsl search: 40/310 traced and priced, 0:06 elapsed, ETA 0:41``.

Plain lines on stderr, not a redrawn bar, so a log file or CI shows them as a terminal does, and
at most one every ``every`` seconds (plus the first and the last), so a fast wait stays short and
a slow one never goes silent. The ETA is the elapsed time per item times the items left. The clock
is a parameter so tests count lines without waiting. Lines print where ``out`` is a terminal (or
``live``): a log or a test capturing stderr keeps only the command's own messages and errors.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TextIO


def duration(seconds: float) -> str:
    """``seconds`` as ``H:MM:SS`` (``M:SS`` under an hour)."""
    s = int(round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


class Waiting:
    """Counts ``total`` items of work for ``command`` and prints where it is (``what`` the items are)."""

    def __init__(
        self,
        command: str,
        what: str,
        total: int,
        every: float = 2.0,
        out: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        live: bool | None = None,
    ) -> None:
        self.command, self.what, self.total, self.every = command, what, total, every
        self.out, self.clock = out, clock
        self.live = live if live is not None else is_terminal(out or sys.stderr)
        self.start = clock()
        self.shown_at: float | None = None
        self.done = 0

    def line(self, note: str = "") -> str:
        """Where the work stands: the count, the time so far, the ETA once one item is done."""
        elapsed = self.clock() - self.start
        eta = "" if not self.done else f", ETA {duration(elapsed / self.done * (self.total - self.done))}"
        note = f" ({note})" if note else ""
        return f"{self.command}: {self.done}/{self.total} {self.what}{note}, {duration(elapsed)} elapsed{eta}"

    def show(self, note: str = "", force: bool = False) -> None:
        """Print the line if ``every`` seconds have passed since the last (or ``force``, or none was shown)."""
        now = self.clock()
        if not self.live:
            return
        if force or self.shown_at is None or now - self.shown_at >= self.every:
            print(self.line(note), file=self.out or sys.stderr, flush=True)
            self.shown_at = now

    def advance(self, n: int = 1, note: str = "") -> None:
        """``n`` more items done; the last always prints."""
        self.done += n
        self.show(note, force=self.done >= self.total)


def is_terminal(out: TextIO) -> bool:
    """Whether ``out`` is a terminal (False for a stream without ``isatty``)."""
    return bool(getattr(out, "isatty", lambda: False)())


HEARTBEAT_S = 10.0
"""Seconds between :func:`heartbeat`'s lines: no command is silent longer."""


@contextlib.contextmanager
def heartbeat(
    command: str, what: str, out: TextIO | None = None, every: float | None = None, live: bool | None = None
) -> Iterator[None]:
    """While the block runs (one long call with no count: a compile, a measurement), a line every ``every``
    seconds (:data:`HEARTBEAT_S`), ``meshdsl train: still compiling the train step, 0:20 elapsed``, so the command
    is never silent longer; printed where ``out`` (default stderr) is a terminal, or ``live``."""
    stream = out or sys.stderr
    if not (live if live is not None else is_terminal(stream)):
        yield
        return
    start, stop, every = time.monotonic(), threading.Event(), HEARTBEAT_S if every is None else every

    def beat() -> None:
        while not stop.wait(every):
            print(f"{command}: still {what}, {duration(time.monotonic() - start)} elapsed", file=stream, flush=True)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
