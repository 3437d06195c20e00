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


@pytest.mark.parametrize(("guess_s", "alive"), [(None, 0), (0.001, 0), (10.0, 1)])
def test_a_guess_of_the_items_time_starts_workers_before_the_first_item(guess_s, alive) -> None:
    """Given a guess that the items take longer than a worker's start, the worker starts beside this process's
    first item, not after it; a guess of short work, or none, starts none before it (and six items of no time
    start none after it either)."""
    pool_items.alive_at_first.clear()
    pool = workers.Pool(pool_items.doubled_noting_workers_alive, "search", pool_items.in_worker, 2)
    assert pool.run(list(range(6)), lambda i, r: None, guess_s) == [0, 2, 4, 6, 8, 10]
    assert pool_items.alive_at_first == [alive]
    if alive == 0:
        assert pool.in_workers == 0


@pytest.mark.parametrize("guess_s", [float("nan"), float("inf"), -1.0, "3"])
def test_a_guess_that_is_no_time_is_refused_before_any_item(guess_s) -> None:
    """A NaN, infinite, negative or non-number guess is a ValueError naming it, before any item is priced."""
    pool_items.alive_at_first.clear()
    pool = workers.Pool(pool_items.doubled_noting_workers_alive, "search", pool_items.in_worker, 2)
    with pytest.raises(ValueError, match=r"guess_s must be a finite number of seconds >= 0, or None; got"):
        pool.run(list(range(6)), lambda i, r: None, guess_s)
    assert pool_items.alive_at_first == []
