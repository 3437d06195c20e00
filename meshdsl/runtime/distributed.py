"""Joining a multi-process run: one JAX process per host (or per group of devices).

Every process of a run calls :func:`initialize` before any JAX computation. It reads where the
coordinator is, how many processes there are and which one this is, from the command-line flags
(``--coordinator HOST:PORT --num-processes N --process-id I``), else from meshdsl's environment
variables (``MESHDSL_COORDINATOR``, ``MESHDSL_NUM_PROCESSES``, ``MESHDSL_PROCESS_ID``: what
``meshdsl launch`` sets), else from the cluster: ``JAX_COORDINATOR_ADDRESS``, a Slurm step with
several tasks, or an Open MPI job with several ranks, which ``jax.distributed.initialize`` reads
itself. With none of these the run is one process and nothing is initialized.

After initialization ``jax.devices()`` lists every process's devices, so a mesh spans them all;
on CPU the collectives between processes go through gloo (JAX's default
``jax_cpu_collectives_implementation``). A process that dies stops sending heartbeats: after the
heartbeat timeout (``--heartbeat-timeout``, else ``MESHDSL_HEARTBEAT_TIMEOUT``, else 5 s) the
coordinator declares it dead and JAX aborts every other process with a message naming it, so a
run never waits long on a lost peer. A process that cannot reach the coordinator gives up after
``INIT_TIMEOUT_S`` with a clear error.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import socket
import sys
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from meshdsl.errors import ConfigError

COORDINATOR_ENV = "MESHDSL_COORDINATOR"
NUM_PROCESSES_ENV = "MESHDSL_NUM_PROCESSES"
PROCESS_ID_ENV = "MESHDSL_PROCESS_ID"
HEARTBEAT_ENV = "MESHDSL_HEARTBEAT_TIMEOUT"

HEARTBEAT_TIMEOUT_S = 5
"""Seconds without a heartbeat after which a process counts as dead and the others stop. JAX's own
default is 100 s; with 5 s a local two-process run whose process 1 is SIGKILLed has process 0
aborted by JAX about 6 s later (JAX 0.10.2 on a loaded 2-core machine: 5.8 s, 3.9 s at 3 s). The
heartbeats come from a thread of JAX's runtime, so long compiles or steps do not silence them."""
INIT_TIMEOUT_S = 120
"""Seconds a process waits for all the others to join before it gives up."""
SHUTDOWN_TIMEOUT_S = 60
"""Seconds a finished process waits at exit for the others to finish (process 0 may still be writing)."""


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """Where a multi-process run meets and who this process is in it."""

    coordinator: str | None
    num_processes: int | None
    process_id: int | None


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer") from None


def _cluster_detected(environ: Mapping[str, str]) -> bool:
    """Whether JAX's own detection will find a multi-process run in ``environ``."""
    if environ.get("JAX_COORDINATOR_ADDRESS"):
        return True
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID")
    if all(k in environ for k in slurm) and _env_int(environ, "SLURM_NTASKS") not in (None, 1):
        return True
    return "OMPI_MCA_orte_hnp_uri" in environ and _env_int(environ, "OMPI_COMM_WORLD_SIZE") not in (None, 1)


def _check_coordinator(address: str) -> None:
    host, colon, port = address.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"coordinator {address!r} is not HOST:PORT with a port in 1..65535, e.g. 10.0.0.1:1234")


def resolve(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> ProcessGroup | None:
    """The run this process belongs to, or None for a single-process run.

    Flags win over ``MESHDSL_*`` variables. A returned group with all fields None means "let
    ``jax.distributed.initialize`` detect the cluster" (``JAX_COORDINATOR_ADDRESS``, Slurm, Open MPI).
    """
    environ = os.environ if environ is None else environ
    coordinator = coordinator or environ.get(COORDINATOR_ENV) or None
    num_processes = num_processes if num_processes is not None else _env_int(environ, NUM_PROCESSES_ENV)
    process_id = process_id if process_id is not None else _env_int(environ, PROCESS_ID_ENV)
    if coordinator is None and num_processes is None and process_id is None:
        return ProcessGroup(None, None, None) if _cluster_detected(environ) else None
    if num_processes is None:
        raise ConfigError(
            f"a multi-process run needs --num-processes (or {NUM_PROCESSES_ENV}) beside the coordinator and process id"
        )
    if num_processes < 1:
        raise ConfigError(f"--num-processes {num_processes}: a run has at least 1 process")
    if process_id is None:
        raise ConfigError(
            f"--num-processes {num_processes} needs --process-id (or {PROCESS_ID_ENV}): which of the processes this is"
        )
    if not 0 <= process_id < num_processes:
        raise ConfigError(
            f"--process-id {process_id} is outside 0..{num_processes - 1} for --num-processes {num_processes}"
        )
    if num_processes == 1:
        return None
    if coordinator is None:
        if not environ.get("JAX_COORDINATOR_ADDRESS"):
            raise ConfigError(
                f"--num-processes {num_processes} needs --coordinator HOST:PORT (or {COORDINATOR_ENV}): where process "
                "0 listens"
            )
    else:
        _check_coordinator(coordinator)
    return ProcessGroup(coordinator, num_processes, process_id)


def wait_for_coordinator(address: str, timeout: float) -> None:
    """Wait until something listens at ``address``; a clear error after ``timeout`` seconds.

    JAX itself would abort the process with a bare DEADLINE_EXCEEDED when process 0 never comes up.
    """
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()
            return
        except OSError as e:
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"no coordinator answers at {address} after {timeout:.0f} s ({e.strerror or e}); is process 0 "
                    "running there?"
                ) from None
            time.sleep(0.5)


def heartbeat_timeout(seconds: int | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Seconds of silence after which a process counts as dead: ``seconds`` (``--heartbeat-timeout``),
    else ``MESHDSL_HEARTBEAT_TIMEOUT``, else ``HEARTBEAT_TIMEOUT_S``; ConfigError below 1."""
    if seconds is not None:
        if seconds < 1:
            raise ConfigError(f"--heartbeat-timeout {seconds}: the heartbeat timeout is at least 1 second")
        return seconds
    value = _env_int(os.environ if environ is None else environ, HEARTBEAT_ENV)
    if value is not None and value < 1:
        raise ConfigError(f"{HEARTBEAT_ENV}={value}: the heartbeat timeout is at least 1 second")
    return HEARTBEAT_TIMEOUT_S if value is None else value


def _options(heartbeat: int) -> dict[str, Any]:
    """The timeouts for ``jax.distributed.initialize``, those this JAX takes (``heartbeat_timeout_seconds``
    and ``shutdown_timeout_seconds`` are absent from older versions; a note says when the heartbeat is)."""
    import jax

    wanted = {
        "initialization_timeout": INIT_TIMEOUT_S,
        "heartbeat_timeout_seconds": heartbeat,
        "shutdown_timeout_seconds": SHUTDOWN_TIMEOUT_S,
    }
    accepted = inspect.signature(jax.distributed.initialize).parameters
    if "heartbeat_timeout_seconds" not in accepted:
        print(
            f"meshdsl: note: JAX {jax.__version__} sets no heartbeat timeout; a dead process is noticed after JAX's "
            "own",
            file=sys.stderr,
        )
    return {k: v for k, v in wanted.items() if k in accepted}


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    heartbeat: int | None = None,
) -> bool:
    """Join the multi-process run the flags or environment describe; True when one was joined.

    ``heartbeat``: the heartbeat timeout in seconds (None: :func:`heartbeat_timeout`'s default).
    Must run before any JAX computation (before anything asks JAX for its devices).
    """
    group = resolve(coordinator, num_processes, process_id)
    timeout = heartbeat_timeout(heartbeat)
    if group is None:
        return False
    import jax

    if group.coordinator is not None and group.process_id != 0:
        wait_for_coordinator(group.coordinator, INIT_TIMEOUT_S)
    try:
        jax.distributed.initialize(group.coordinator, group.num_processes, group.process_id, **_options(timeout))
    except (RuntimeError, ValueError) as e:
        where = (
            f"{group.coordinator} as process {group.process_id} of {group.num_processes}"
            if group.coordinator
            else "the detected cluster"
        )
        raise ConfigError(f"could not join the multi-process run at {where}: {str(e).splitlines()[0]}") from None
    return True


def joined() -> bool:
    """Whether this process joined a multi-process run (without starting JAX's devices)."""
    import jax

    return jax.distributed.is_initialized()


def is_primary() -> bool:
    """Whether this process is the one that prints and writes results (process 0)."""
    import jax

    return jax.process_index() == 0


def local_value(x: Any) -> np.ndarray:
    """The value of a replicated array, read from this process's own copy (works across processes)."""
    import jax

    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(x.addressable_data(0))
    return np.asarray(x)


_PEER_GONE = re.compile(
    r"Gloo \w+(?: \w+)? failed: [^\n]*"
    r"(?:Connection reset by peer|Connection closed by peer|Connection refused|Read timeout|Read error|Broken pipe)"
    r"[^\n]*"
)
"""gloo's words, in a collective's error, for a connection to another process that broke, was refused (a new
gloo context whose peer is gone: "Gloo context initialization failed") or went silent."""


def peer_gone(error: BaseException) -> str | None:
    """Why a collective failed, said for a user, where ``error`` is gloo's broken or silent connection to
    another process of the run; else None. Such a process is a survivor: the traceback of where its
    collective stood says nothing, and the launcher names the process that failed first."""
    match = _PEER_GONE.search(str(error))
    if match is None:
        return None
    return (
        f"a collective between the processes failed ({match.group(0)}): another process of the run is gone or "
        "stalled (meshdsl launch names the one that failed first)"
    )


def exit_now(code: int) -> None:
    """Leave a multi-process run at once after a failure, skipping JAX's shutdown barrier.

    The barrier would wait for the other processes, which are themselves waiting for this one in a
    collective; leaving without it stops this process's heartbeats, so the others end promptly.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
