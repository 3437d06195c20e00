"""A pytest plugin: an xdist worker that has finished its tests ignores SIGINT while it tears down.

Why: when every worker has reported its session finished, the xdist controller closes their
execnet gateways; execnet's worker side (``WorkerGateway._terminate_execution``) waits 5 s for
the worker's pytest to return and then sends its own process a SIGINT. A worker of this suite
is still tearing down then (its ``pytest_unconfigure`` garbage-collects a heap of JAX objects on
two shared cores), and the KeyboardInterrupt lands in whatever Python code runs at that moment:
inside ``gc.collect()`` that is hypothesis's gc-time accounting callback
(``gc_cumulative_time.<locals>.gc_callback``), where an exception cannot propagate, so pytest
reports it as a ``PytestUnraisableExceptionWarning`` with a raw ``KeyboardInterrupt`` traceback
after the green summary (issue 24). The worker's results are already with the controller, so
nothing is lost by letting it finish: execnet still ends it with ``os._exit`` 10 s later if it
does not. A Ctrl-C before the session finished interrupts the worker as before.
"""

from __future__ import annotations

import signal
import threading

import pytest


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    if hasattr(session.config, "workerinput") and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
