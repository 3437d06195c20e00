"""The suite ends without a raw KeyboardInterrupt from hypothesis's gc callback (issue 24; see
tests/worker_teardown.py for the cause). A small project reproduces it: a hypothesis test (which
installs the gc callback) and a worker teardown that garbage-collects for longer than execnet's
5 s wait. Without the plugin it ends with a ``PytestUnraisableExceptionWarning`` holding
``KeyboardInterrupt`` in ``gc_callback``; with it, with nothing after the summary."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

PROJECT = {
    "test_drawn.py": (
        "from hypothesis import given, strategies as st\n\n\n"
        "@given(st.integers())\n"
        "def test_drawn(x):\n"
        "    assert x == x\n"
    ),
    "conftest.py": (
        "import gc, time\n\n\n"
        "class Cycle:\n"
        "    def __init__(self):\n"
        "        self.me = self\n\n\n"
        "def pytest_unconfigure(config):  # a teardown that collects garbage for 7 s, as a JAX-heavy worker's\n"
        "    if hasattr(config, 'workerinput'):\n"
        "        end = time.monotonic() + 7\n"
        "        while time.monotonic() < end:\n"
        "            junk = [Cycle() for _ in range(20000)]\n"
        "            del junk\n"
        "            gc.collect()\n"
    ),
    "pytest.ini": "[pytest]\n",
}


def test_a_worker_still_tearing_down_when_the_controller_leaves_is_not_interrupted(tmp_path) -> None:
    for name, text in PROJECT.items():
        (tmp_path / name).write_text(text)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "1", "-p", "no:cacheprovider", "-p", "worker_teardown"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    printed = done.stdout + done.stderr
    assert done.returncode == 0 and "1 passed" in printed, printed
    assert "KeyboardInterrupt" not in printed and "Unraisable" not in printed, printed


def test_this_suite_has_the_hook(request) -> None:
    from worker_teardown import pytest_sessionfinish

    plugins = request.config.pluginmanager.get_plugins()
    assert any(getattr(p, "pytest_sessionfinish", None) is pytest_sessionfinish for p in plugins)
