"""planner.workers.Pool when a worker dies or fails: nothing is lost, and the error reaches the search."""

from __future__ import annotations

import pool_items
import pytest

from meshdsl.planner import workers


def test_a_worker_that_dies_loses_nothing(a_worker_takes_the_second_item) -> None:
    a_worker_takes_the_second_item()
    pool = workers.Pool(pool_items.doubled_here_dies_there, "search", pool_items.in_worker, 2)
    assert pool.run(list(range(6)), lambda i, r: None) == [0, 2, 4, 6, 8, 10]
    assert pool.in_workers == 0


def test_an_error_in_a_worker_is_raised_in_the_search(a_worker_takes_the_second_item) -> None:
    a_worker_takes_the_second_item()
    pool = workers.Pool(pool_items.doubled_here_fails_there, "search", pool_items.in_worker, 2)
    with pytest.raises(ValueError, match="item 1 failed in a worker"):
        pool.run(list(range(6)), lambda i, r: None)
