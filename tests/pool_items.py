"""Picklable stand-ins for a search's pricing, for tests/test_workers.py (a spawned worker imports this module)."""

from __future__ import annotations

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
