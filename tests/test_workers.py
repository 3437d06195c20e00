"""planner.workers.Pool when a worker dies or fails: nothing is lost, and the error reaches the search."""

from __future__ import annotations

import time
from typing import Any

import pool_items
import pytest

from meshdsl.planner import workers


@pytest.fixture
def a_worker_takes_the_second_item(monkeypatch) -> None:
    """Workers start after this process's first item, and this process takes its next only once a worker took one."""
    taken, calls = workers._taken, []

    def after_a_worker(counter: Any) -> int:
        calls.append(True)
        deadline = time.monotonic() + 120
        while len(calls) == 2 and counter.value < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        return taken(counter)

    monkeypatch.setattr(workers, "_taken", after_a_worker)
    monkeypatch.setattr(workers, "WORKER_START_S", 0.0)


def test_a_worker_that_dies_loses_nothing(a_worker_takes_the_second_item) -> None:
    pool = workers.Pool(pool_items.doubled_here_dies_there, "search", pool_items.in_worker, 2)
    assert pool.run(list(range(6)), lambda i, r: None) == [0, 2, 4, 6, 8, 10]
    assert pool.in_workers == 0


def test_an_error_in_a_worker_is_raised_in_the_search(a_worker_takes_the_second_item) -> None:
    pool = workers.Pool(pool_items.doubled_here_fails_there, "search", pool_items.in_worker, 2)
    with pytest.raises(ValueError, match="item 1 failed in a worker"):
        pool.run(list(range(6)), lambda i, r: None)
