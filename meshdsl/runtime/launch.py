"""``meshdsl launch --local N -- train ...``: a multi-process run on this host.

Starts N processes of ``python -m meshdsl.cli <command>``, each with its own simulated CPU
devices, joined through a coordinator on a free port of 127.0.0.1 (the ``MESHDSL_*`` variables
that :mod:`meshdsl.runtime.distributed` reads). Their output is forwarded line by line as ``[p0] ...``.

When a process ends badly (non-zero exit or a signal), the launcher says which one and how, gives
the others the heartbeat timeout plus a margin to stop on their own (JAX ends them with a message
naming the lost process), then sends SIGTERM and, 5 s later, SIGKILL: it never waits forever.
Ctrl-C (SIGINT) and SIGTERM are forwarded to every process; a second one kills them.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, TextIO

from meshdsl.errors import ConfigError
from meshdsl.runtime import distributed
from meshdsl.runtime.devices import MAX_SIMULATED_DEVICES

COMMANDS = ("train", "bench")
MARGIN_S = 10
"""Seconds beyond the heartbeat timeout that the others get to stop by themselves after a failure."""
KILL_AFTER_S = 5
"""Seconds between SIGTERM and SIGKILL."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def describe(code: int) -> str:
    """How a process ended, from ``Popen.returncode``: ``exited with code 2``, ``was killed by SIGKILL``."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _exit_code(code: int) -> int:
    """A shell-style exit status: 128 + signal for a process a signal ended."""
    return 128 - code if code < 0 else code


_NATIVE_FRAME = re.compile(r"^\*\*\* Check failure stack trace: \*\*\*$|^\s+@\s+0x[0-9a-f]+\s")
"""A line of the C++ stack trace JAX's runtime prints when it aborts a process (after another died)."""
_NATIVE_LOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ \S+:\d+\] ")
"""A log line of JAX's C++ runtime (absl's ``E1126 06:40:00.123456  1234 file.cc:12] ...``): shown only
with ``--verbose``; the launcher names the process at fault itself."""
_GLOO = re.compile(r"\[Gloo\] Rank |^\d+ is connected to \d+ peer ranks")
"""Gloo's connection message (whole, or two of them interleaved): shown only with ``--verbose``."""
_OWN = re.compile(r"^(meshdsl|Traceback|\S*Warning: )")
"""The start of a line of the process's own (Python) output: it ends a runtime log message's continuation
lines (JAX's messages run over several: the unhealthy tasks, one per line; the RPC that failed)."""
STOPPED_S = 1.0
"""Seconds a process must stay stopped (state ``T``: SIGSTOP, a frozen process) before the launcher
counts it as failed."""


class _Forwarder:
    """Copies each child's lines to our stdout / stderr with a ``[pI] `` prefix, whole lines at a time.

    C++ stack-trace lines are counted, not copied: JAX's runtime prints one when it stops a process
    whose peer died, and its frames say nothing about the user's run. Without ``verbose``, the
    runtime's log lines and Gloo's connection messages are counted too. ``omitted`` counts them per process.
    """

    def __init__(self, out: TextIO, err: TextIO, verbose: bool = True):
        self.out, self.err, self.verbose = out, err, verbose
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self.omitted: dict[int, int] = {}

    def _hidden(self, line: str, after_log: bool) -> bool:
        """Whether ``line`` is left out (and counted): a stack frame, or unless verbose a runtime log
        line (or a line continuing one: ``after_log``) or a Gloo message."""
        if _NATIVE_FRAME.match(line):
            return True
        if self.verbose:
            return False
        return bool(_NATIVE_LOG.match(line) or _GLOO.search(line) or (after_log and not _OWN.match(line)))

    def follow(self, rank: int, stream: IO[bytes], sink: TextIO) -> None:
        def copy() -> None:
            after_log = False
            for raw in iter(stream.readline, b""):
                line = raw.decode(errors="replace").rstrip("\r\n")
                with self.lock:
                    hidden = self._hidden(line, after_log)
                    runtime = after_log or bool(_NATIVE_LOG.match(line))
                    after_log = hidden and not self.verbose and runtime and not _GLOO.search(line)
                    if hidden:
                        self.omitted[rank] = self.omitted.get(rank, 0) + 1
                        continue
                    sink.write(f"[p{rank}] {line}\n")
                    sink.flush()
            stream.close()

        thread = threading.Thread(target=copy, daemon=True)
        thread.start()
        self.threads.append(thread)

    def join(self) -> None:
        for thread in self.threads:
            thread.join(timeout=KILL_AFTER_S)


def child_command(command: Sequence[str]) -> list[str]:
    """The command each process runs (``train ...`` or ``bench ...``; a leading ``--`` dropped); ConfigError for
    others."""
    command = list(command[1:] if command and command[0] == "--" else command)
    if not command or command[0] not in COMMANDS:
        got = f"{command[0]!r}" if command else "nothing"
        raise ConfigError(
            f"meshdsl launch runs {' or '.join(COMMANDS)}, e.g. 'meshdsl launch --local 2 -- train --preset tiny'; "
            f"got {got}"
        )
    return command


def split_devices(processes: int, given: int | None = None) -> int:
    """Simulated CPU devices in each of ``processes`` processes: ``given``, else ``8 // processes``
    (at least 1), so N processes together have the 8 devices of a one-process run. ConfigError
    for a ``given`` outside 1..``devices.MAX_SIMULATED_DEVICES``."""
    devices = max(1, 8 // processes) if given is None else given
    if not 1 <= devices <= MAX_SIMULATED_DEVICES:
        raise ConfigError(
            f"--devices-per-process {devices}: each process simulates 1 to {MAX_SIMULATED_DEVICES} devices"
        )
    return devices


def launch(
    command: Sequence[str],
    processes: int,
    devices_per_process: int | None = None,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
    heartbeat: int | None = None,
    verbose: bool = False,
) -> int:
    """Run ``meshdsl <command>`` as ``processes`` processes on this host; the exit status of the
    process that failed first (0 when none failed).

    ``devices_per_process``: simulated CPU devices in each (default ``8 // processes``, at least 1,
    so that N processes together have the 8 devices of a one-process run; at most
    ``devices.MAX_SIMULATED_DEVICES``). ``heartbeat``: the heartbeat timeout in seconds the processes
    use (None: ``MESHDSL_HEARTBEAT_TIMEOUT``, else ``distributed.HEARTBEAT_TIMEOUT_S``). ``verbose``:
    also forward JAX's C++ log lines and Gloo's connection messages (else only counted).
    """
    command = child_command(command)
    if processes < 1:
        raise ConfigError(f"--local {processes}: launch at least 1 process")
    devices = split_devices(processes, devices_per_process)
    timeout = distributed.heartbeat_timeout(heartbeat)
    grace = timeout + MARGIN_S
    coordinator = f"127.0.0.1:{free_port()}"
    forward = _Forwarder(out, err, verbose)
    children: list[subprocess.Popen] = []
    try:
        for rank in range(processes):
            env = {
                **os.environ,
                "PYTHONUNBUFFERED": "1",
                distributed.COORDINATOR_ENV: coordinator,
                distributed.NUM_PROCESSES_ENV: str(processes),
                distributed.PROCESS_ID_ENV: str(rank),
                distributed.HEARTBEAT_ENV: str(timeout),
            }
            child = subprocess.Popen(
                [sys.executable, "-m", "meshdsl.cli", "--devices", str(devices), *command],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            children.append(child)
            assert child.stdout is not None and child.stderr is not None  # both piped above
            forward.follow(rank, child.stdout, out)
            forward.follow(rank, child.stderr, err)
        pids = ", ".join(f"process {r} pid {c.pid}" for r, c in enumerate(children))
        _say(err, forward, f"{processes} processes x {devices} devices, coordinator {coordinator}: {pids}")
        codes, first = _supervise(children, grace, err, forward)
    finally:
        for child in children:
            if child.poll() is None:
                _signal(child, signal.SIGKILL)
                child.wait()
        forward.join()
    return _exit_code(codes[first]) if first is not None else max(_exit_code(c) for c in codes)


def _say(err: TextIO, forward: _Forwarder, message: str) -> None:
    with forward.lock:
        err.write(f"meshdsl launch: {message}\n")
        err.flush()


def _signal(child: subprocess.Popen, sig: signal.Signals) -> None:
    """Send ``sig`` to the child's process group (it and anything it started)."""
    try:
        os.killpg(child.pid, sig)
    except ProcessLookupError:
        pass


def _supervise(
    children: list[subprocess.Popen], grace: float, err: TextIO, forward: _Forwarder
) -> tuple[list[int], int | None]:
    """Wait for every child; after the first failure or interrupt, stop the rest by the deadlines.

    Returns every child's exit code and the rank that failed first unprompted (None: none did, or
    the run was interrupted)."""
    interrupts: list[signal.Signals] = []

    def on_signal(signum: int, frame: object) -> None:
        interrupts.append(signal.Signals(signum))

    in_main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)} if in_main else {}
    try:
        stop_at: float | None = None
        first: int | None = None
        terminated = False
        forwarded = 0
        stopped_since: dict[int, float] = {}
        frozen: set[int] = set()
        while None in (now := [c.poll() for c in children]):
            if len(interrupts) > forwarded:
                sig = signal.SIGKILL if forwarded else interrupts[forwarded]
                forwarded = len(interrupts)
                _say(err, forward, f"{interrupts[-1].name}: sending {sig.name} to every process")
                for child in children:
                    _signal(child, sig)
                stop_at = stop_at or time.monotonic() + grace
            failed = _failures(now)
            if stop_at is None:
                for rank, child in enumerate(children):
                    if _stopped(child):
                        stopped_since.setdefault(rank, time.monotonic())
                    else:
                        stopped_since.pop(rank, None)
                frozen = {r for r, t in stopped_since.items() if time.monotonic() - t >= STOPPED_S}
                if frozen:
                    first = min(frozen)
                    stop_at = time.monotonic()  # a frozen process answers nothing: stop every process now
                    frozen_line = f"process {first} is stopped (frozen: SIGSTOP or a debugger) and no longer answers"
                    _say(err, forward, f"{frozen_line}; stopping every process")
            if failed and stop_at is None:
                stop_at = time.monotonic() + grace
                rank, code = failed[0]
                first = rank
                _say(
                    err,
                    forward,
                    f"process {rank} {describe(code)}; stopping the others (at most {grace + KILL_AFTER_S:.0f} s)",
                )
            if stop_at is not None and time.monotonic() > stop_at and not terminated:
                terminated = True
                _say(err, forward, "sending SIGTERM to the processes still running")
                for child in children:
                    _signal(child, signal.SIGTERM)
            if terminated and stop_at is not None and time.monotonic() > stop_at + KILL_AFTER_S:
                for child in children:
                    _signal(child, signal.SIGKILL)
            time.sleep(0.1)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    codes = [c.wait() for c in children]
    forward.join()
    if first is None and _failures(codes):  # every failure came after the last look (or before the first)
        first = _failures(codes)[0][0]
    if any(codes):
        omitted = ", ".join(f"{n} from process {r}" for r, n in sorted(forward.omitted.items()))
        note = f" (JAX runtime lines omitted: {omitted}; --verbose shows them)" if omitted else ""
        _say(err, forward, _summary(codes, None if interrupts else first, frozen) + note)
    return codes, None if interrupts else first


def _failures(codes: Sequence[int | None]) -> list[tuple[int, int]]:
    """``(rank, code)`` of the processes that failed, the likely first first. Deaths one look sees
    together are ordered: killed by a signal from outside (SIGKILL, SIGSEGV: before the launcher
    stops anyone, no signal is its), then exited with a status, then SIGABRT, each by rank. A
    survivor that notices a peer gone ends with SIGABRT (JAX's coordinator) or a status (gloo's
    error raised in a collective, at once), never by another signal, so a signal's death beside
    theirs came first."""
    failed = [(rank, code) for rank, code in enumerate(codes) if code is not None and code != 0]

    def order(failure: tuple[int, int]) -> tuple[int, int]:
        rank, code = failure
        return (2 if code == -signal.SIGABRT else 0 if code < 0 else 1), rank

    return sorted(failed, key=order)


def _stopped(child: subprocess.Popen) -> bool:
    """Whether the child is stopped (state ``T`` in ``/proc``: SIGSTOP); False where there is no ``/proc``."""
    try:
        with open(f"/proc/{child.pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] == "T"
    except (OSError, IndexError):
        return False


def _summary(codes: list[int], first: int | None, frozen: set[int] | frozenset = frozenset()) -> str:
    """How the processes ended; with ``first`` (the rank that failed first, unprompted), it leads
    and the others are said to have stopped because of it: a survivor's own last words (JAX's
    heartbeat abort, or gloo's transport error when a collective was in flight) may not name it."""
    if first is None:
        return "; ".join(f"process {r} {describe(c)}" for r, c in enumerate(codes) if c != 0)
    after = [f"process {r} {describe(c)}" for r, c in enumerate(codes) if c != 0 and r != first]
    how = f"froze (stopped) and {describe(codes[first])}" if first in frozen else describe(codes[first])
    cause = f"process {first} {how} first"
    return cause + (f"; then, because of it: {', '.join(after)}" if after else "")
