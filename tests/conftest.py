"""Test setup: 8 simulated CPU devices, fast compiles, and reproducible hypothesis settings.

This file is imported by pytest before any test module, so it sets ``XLA_FLAGS`` before anything
imports jax: ``pytest`` alone works on a fresh machine. Other flags the user set are kept; a
``--xla_force_host_platform_device_count`` already present is replaced by ours.

Compiling dominates the suite's time on a CPU, so LLVM runs unoptimised
(``--xla_backend_optimization_level=0``, unless the user set it): it acts after XLA's HLO passes,
so partitioning, collectives, fusion and buffers are the same and only the machine code is
slower; a benchmark test's compile takes about 40% less time. Subprocesses the tests start
inherit it.
"""

import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest

DEVICE_COUNT = 8
_FLAG = "--xla_force_host_platform_device_count"

if "jax" in sys.modules:  # pragma: no cover - only when a plugin imported jax before us
    raise RuntimeError(
        "jax was imported before tests/conftest.py could set XLA_FLAGS; the tests need "
        f"{_FLAG}={DEVICE_COUNT} (set it yourself, or stop the plugin that imports jax)"
    )

_OPT_LEVEL = "--xla_backend_optimization_level"

_others = re.sub(rf"{_FLAG}=\S*", "", os.environ.get("XLA_FLAGS", "")).split()
_fast = [] if any(f.startswith(_OPT_LEVEL) for f in _others) else [f"{_OPT_LEVEL}=0"]
os.environ["XLA_FLAGS"] = " ".join([*_others, *_fast, f"{_FLAG}={DEVICE_COUNT}"])
# The suite is written for the simulated host devices; a machine with an accelerator still runs
# it on CPU unless the user chose the platform.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from cpu_times import pytest_addoption, pytest_configure, pytest_runtest_protocol  # noqa: E402, F401 (--cpu-times FILE)
from hypothesis import HealthCheck, Phase, settings  # noqa: E402
from worker_teardown import pytest_sessionfinish  # noqa: E402, F401 (a hook: an xdist worker done ignores SIGINT)

# derandomize: the same examples on every run and every machine (CI is reproducible, and with
# the test tools pinned in pyproject.toml, every machine draws the same examples);
# database=None: no example database to make runs differ; deadline=None: the first example of
# a test pays for jax's warm-up, which says nothing about the code under test.
# Shrinking is off by default: an example compiles several XLA programs (about a second), so
# shrinking a failure can take many minutes. The failing example is printed with its labelled
# draws either way; to shrink it, run with --hypothesis-profile=meshdsl-shrink.
#
# Each test asks for ``strategies.examples(n)`` examples: n under the default profile, and
# n * max_examples / 100 under another, so the profile's max_examples is a percentage.
# --hypothesis-profile=fuzz is the deep run: unseeded (new examples every run), 10x the
# examples, shrinking on. --hypothesis-profile=explore draws as many examples as CI, but other
# ones: with --hypothesis-seed=N, a reproducible look beyond CI's draws. A failure either finds
# becomes a named regression test.
_COMMON = dict(
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
settings.register_profile(
    "meshdsl", derandomize=True, max_examples=100, phases=[Phase.explicit, Phase.generate], **_COMMON
)
settings.register_profile("meshdsl-shrink", derandomize=True, max_examples=100, **_COMMON)
settings.register_profile("fuzz", derandomize=False, max_examples=1000, **_COMMON)
settings.register_profile(
    "explore", derandomize=False, max_examples=100, phases=[Phase.explicit, Phase.generate], **_COMMON
)
settings.load_profile("meshdsl")

# The test files that take longest, longest first (pytest --durations=0 summed per file, JAX 0.12).
# Under --dist loadfile a file runs whole on one worker, and with --no-loadscope-reorder (addopts)
# xdist hands files out in collection order. Its default orders them by test count, which started
# the random programs (few tests, minutes each) last and left one worker idle at the end.
LONGEST_FILES = (
    "test_programs.py",
    "test_programs_more.py",
    "test_context_attention.py",
    "test_generate.py",
    "test_generate_cli.py",
    "test_hf.py",
    "test_hf_cli.py",
    "test_signals.py",
    "test_pipeline.py",
    "test_planner.py",
    "test_cli.py",
    "test_training.py",
    "test_llm_layers.py",
    "test_indexing.py",
    "test_bench.py",
    "test_multiprocess.py",
)


def pytest_collection_modifyitems(items: list) -> None:
    """The longest files first (a stable sort: every file's tests keep their order)."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture
def a_worker_takes_the_second_item(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """A function that makes ``planner.workers.Pool`` start its workers whatever the time left (at once where it has a
    guess, else after this process's first item), and this process take its second item only once a worker has taken
    one, so a worker surely gets some however fast this process is (patched in this process only: a spawned worker
    imports its own). Called, not applied at once: a run without workers before it would wait for one that never
    comes."""
    from meshdsl.planner import workers

    def arm() -> None:
        taken, calls = workers._taken, []

        def after_a_worker(counter: Any) -> int:
            calls.append(True)
            deadline = time.monotonic() + 120
            while len(calls) == 2 and counter.value < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            return taken(counter)

        monkeypatch.setattr(workers, "_taken", after_a_worker)
        monkeypatch.setattr(workers, "WORKER_START_S", 0.0)

    return arm
