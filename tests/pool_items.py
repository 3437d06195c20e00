"""Picklable stand-ins for a search's pricing, for tests/test_workers.py (a spawned worker imports this module)."""

from __future__ import annotations

import multiprocessing
import os


def in_worker() -> str:
    """A worker's context."""
    return "worker"


def doubled_here_dies_there(context: str, item: int) -> int:
    """``2 * item`` in the search's process; a worker process exits at once (killed, as for memory)."""
    if context == "worker":
        os._exit(3)
    return 2 * item


def doubled_here_fails_there(context: str, item: int) -> int:
    """``2 * item`` in the search's process; a worker raises."""
    if context == "worker":
        raise ValueError(f"item {item} failed in a worker")
    return 2 * item


def doubled_noting_workers_alive(context: str, item: int) -> int:
    """``2 * item``; in the search's process, item 0 also notes how many worker processes are alive as it starts
    (:data:`alive_at_first`)."""
    if context != "worker" and item == 0:
        alive_at_first.append(len(multiprocessing.active_children()))
    return 2 * item


alive_at_first: list[int] = []
"""How many workers were alive when the search's process began item 0, one entry per run."""
