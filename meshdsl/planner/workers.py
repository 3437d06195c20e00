"""Pricing a search's candidates on several cores at once.

Tracing and pricing one candidate is pure Python (nothing is compiled), so one process prices one
candidate at a time on one core: the 8B llama's 73 candidates on 64 devices took 99 s on one core of a
2-core machine while the other core idled. The candidates are independent, so worker processes price
them beside the search's own process:

* the workers are *spawned*, not forked (a fork of a process whose JAX threads are running can
  deadlock), and each rebuilds what pricing needs once, from ``setup``: a picklable function (a
  model loaded from a user's file cannot be pickled; the loader's arguments can);
* workers start once the candidates left are predicted to take longer than :data:`WORKER_START_S`,
  about what a worker takes to start (importing JAX, rebuilding the model): before the first
  candidate where the search has a guess of a candidate's time (what tracing the step once on
  global arrays took), else after it (its time, times those left); a short search (a tiny MLP's
  takes a second) starts none;
* every process, the search's own included, takes the next candidate from one shared counter, so
  none waits while another has work left, and the search's process goes on pricing while the
  workers start;
* each candidate is priced by the same function in whichever process takes it, so the result is
  the same, candidate for candidate; only the wall time changes
  (``test_planner.py::test_a_search_priced_in_worker_processes_gives_the_same_result``);
* a worker that dies (killed for memory, say) loses nothing: the search's process prices the
  candidate it held; an exception raised by ``price`` in a worker is raised in the search.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any, Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")

MAX_WORKERS = 8
"""The default's cap: past it a worker's start-up (its own JAX, its own model) buys little."""

WORKER_START_S = 3.0
"""About the seconds a worker takes to start: work predicted to take less is done sooner without one."""


def default_workers() -> int:
    """The processes a search uses by default: the CPUs this process may run on, at most :data:`MAX_WORKERS`."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(usable, MAX_WORKERS))


def _taken(counter: Any) -> int:
    """The next item's index, taken from the shared ``counter`` (each index by one process only)."""
    with counter.get_lock():
        i = int(counter.value)
        counter.value = i + 1
    return i


def _work(
    setup: Callable[[], Any], price: Callable[[Any, Any], Any], items: Sequence[Any], counter: Any, out: Connection
) -> None:
    """A worker: build the context, then price items until none is left, sending ``(index, result, error)``.

    A worker that cannot build its context leaves: the search's process prices what it would have."""
    try:
        context = setup()
    except Exception:
        return
    while (i := _taken(counter)) < len(items):
        try:
            message: tuple[int, Any, BaseException | None] = (i, price(context, items[i]), None)
        except BaseException as e:  # raised in the search's process, which decides
            message = (i, None, e)
        try:
            out.send(message)
        except Exception as e:  # the result or error does not pickle: say so rather than lose it
            out.send((i, None, RuntimeError(f"a worker could not send back item {i}'s outcome: {e!r}")))


class Pool(Generic[Item, Result]):
    """Prices ``items`` with ``price(context, item)`` in this process and, once the items left are predicted to
    take longer than :data:`WORKER_START_S`, in up to ``processes - 1`` spawned workers whose context is
    ``setup()`` (none without ``setup``)."""

    def __init__(
        self, price: Callable[[Any, Item], Result], context: Any, setup: Callable[[], Any] | None, processes: int
    ) -> None:
        self.price, self.context, self.setup, self.processes = price, context, setup, processes
        self.in_workers = 0
        """How many items of the last :meth:`run` the workers priced."""

    def run(
        self, items: Sequence[Item], done: Callable[[int, Result], None], guess_s: float | None = None
    ) -> list[Result]:
        """Every item priced (``done(index, result)`` as each finishes, in any order); the results in item order.

        ``guess_s``: about the seconds an item takes, known before any is priced; workers then start at once where
        the items would take longer than :data:`WORKER_START_S`, their start-up beside this process's first item
        (the first a process prices is its slowest: JAX's caches are cold). An exception that ``price`` raises, here
        or in a worker, is raised here, the workers stopped."""
        if guess_s is not None and not (isinstance(guess_s, (int, float)) and math.isfinite(guess_s) and guess_s >= 0):
            raise ValueError(f"Pool.run: guess_s must be a finite number of seconds >= 0, or None; got {guess_s!r}")
        results: dict[int, Result] = {}
        here = 0
        spawn = multiprocessing.get_context("spawn")
        counter = spawn.Value("l", 0)
        workers: list[tuple[Any, Connection]] = []
        began = time.monotonic()

        def start_workers(each_s: float) -> None:
            left = len(items) - int(counter.value)
            predicted = each_s * left
            if self.setup is None or left < 2 or predicted <= WORKER_START_S:
                return
            for _ in range(min(self.processes - 1, left - 1)):
                receive, send = spawn.Pipe(duplex=False)
                process = spawn.Process(target=_work, args=(self.setup, self.price, items, counter, send), daemon=True)
                process.start()
                send.close()
                workers.append((process, receive))

        def record(i: int, result: Result) -> None:
            results[i] = result
            done(i, result)

        def collect(timeout: float | None) -> None:
            for conn in wait([r for _, r in workers], timeout):
                assert isinstance(conn, Connection)
                try:
                    i, result, error = conn.recv()
                except EOFError:  # the worker has left (done, or died: what it held is priced below)
                    workers[:] = [(p, r) for p, r in workers if r is not conn]
                    continue
                if error is not None:
                    raise error
                record(i, result)

        try:
            if guess_s is not None and self.processes > 1:
                start_workers(guess_s)
            while (i := _taken(counter)) < len(items):
                record(i, self.price(self.context, items[i]))
                here += 1
                if workers:
                    collect(0)
                elif self.processes > 1:
                    start_workers((time.monotonic() - began) / here)
            while workers and len(results) < len(items):
                collect(None)
            for i in range(len(items)):  # held by a worker that died
                if i not in results:
                    record(i, self.price(self.context, items[i]))
                    here += 1
        finally:
            for process, receive in workers:
                process.terminate()
                process.join()
                receive.close()
        self.in_workers = len(items) - here
        return [results[i] for i in range(len(items))]
