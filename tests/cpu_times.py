"""A pytest plugin: ``--cpu-times FILE`` appends each test's CPU seconds to FILE, one JSON line a test.

Why CPU and not pytest's ``--durations``: on a shared 2-core host a test's wall time says as much
about the other processes as about the test, while the CPU seconds its process (XLA's threads
included) and the subprocesses it waited for spend are nearly the same however loaded the host is.
The suite's wall time on an idle host is about their sum over the two xdist workers, so the sum
per file says where the suite's time goes. Run as a script, this file prints those sums:

    python -m pytest --cpu-times /tmp/cpu.jsonl
    python tests/cpu_times.py /tmp/cpu.jsonl
"""

from __future__ import annotations

import collections
import json
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-times", metavar="FILE", help="append each test's CPU seconds to FILE (JSON lines)")


def pytest_configure(config: pytest.Config) -> None:
    """A ``--cpu-times`` file that cannot be written is one line before any test runs, not an error after the first."""
    path = config.getoption("--cpu-times")
    if path and (Path(path).is_dir() or not Path(path).parent.is_dir()):
        raise pytest.UsageError(f"--cpu-times {path}: not a file in an existing folder")


def _cpu_seconds() -> float:
    """CPU seconds of this process and of the children it has waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    path = item.config.getoption("--cpu-times")
    cpu, wall = _cpu_seconds(), time.perf_counter()
    yield
    if path:
        record = {"id": item.nodeid, "cpu": _cpu_seconds() - cpu, "wall": time.perf_counter() - wall}
        with open(path, "a") as out:
            out.write(json.dumps(record) + "\n")


def main(path: str) -> None:
    """Print CPU seconds and test counts per file, most first, and the total."""
    per_file: collections.Counter[str] = collections.Counter()
    tests: collections.Counter[str] = collections.Counter()
    with open(path) as lines:
        for line in lines:
            record = json.loads(line)
            name = record["id"].split("::")[0]
            per_file[name] += record["cpu"]
            tests[name] += 1
    for name, seconds in per_file.most_common():
        print(f"{seconds:8.0f} s {tests[name]:5d} tests  {name}")
    print(f"{sum(per_file.values()):8.0f} s {sum(tests.values()):5d} tests  in all")


if __name__ == "__main__":
    main(sys.argv[1])
