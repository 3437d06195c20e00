"""Choosing and starting JAX's devices before the first computation, for every command.

On a machine without an accelerator and without a device count in ``XLA_FLAGS``, a command
simulates ``--devices`` CPU devices (8 by default) so layouts can be compared on a laptop; on a
GPU or TPU host it uses the accelerators as they are. Here, not in :mod:`meshdsl.cli`, so that the
commands (``meshdsl launch``'s device split) and ``python -m meshdsl.planner.validate`` import it
without importing the command line.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

DEVICE_FLAG = "--xla_force_host_platform_device_count"
MAX_SIMULATED_DEVICES = 2048
"""The most CPU devices one process can simulate. JAX numbers process ``p``'s CPU devices from
``p * 2048`` (device ids of process 1 start at 2048), so with more, the devices from id 2048 on
count as another process's and every computation over them fails ("Multiprocess computations
aren't implemented on the CPU backend", checked with JAX 0.10.2); far more (``--devices 1000000``)
only fills memory for minutes before that. More devices: ``meshdsl launch --local N``."""


def simulate_devices(count: int | None) -> None:
    """Ask for ``count`` CPU devices (None: 8) before JAX starts, unless ``count`` is None and the
    user's XLA_FLAGS already chose. ConfigError for a count below 1 or above ``MAX_SIMULATED_DEVICES``."""
    from meshdsl.errors import ConfigError

    if count is not None and count < 1:
        raise ConfigError(f"--devices {count}: simulate at least 1 device")
    if count is not None and count > MAX_SIMULATED_DEVICES:
        raise ConfigError(
            f"--devices {count}: one process simulates at most {MAX_SIMULATED_DEVICES} CPU devices (JAX numbers "
            f"the next process's devices from {MAX_SIMULATED_DEVICES}); spread more over processes with meshdsl launch "
            "--local N"
        )
    if DEVICE_FLAG in os.environ.get("XLA_FLAGS", "") and count is None:
        return
    import jax

    jax.config.update("jax_num_cpu_devices", count or 8)


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """ConfigError for environment variables JAX would choke on before any message of ours: a device
    count in ``XLA_FLAGS`` that is not a positive integer (XLA prints its whole flag help and aborts)."""
    from meshdsl.errors import ConfigError

    environ = os.environ if environ is None else environ
    for value in re.findall(rf"{DEVICE_FLAG}=(\S*)", environ.get("XLA_FLAGS", "")):
        if not value.isdigit() or int(value) < 1:
            raise ConfigError(
                f"XLA_FLAGS has {DEVICE_FLAG}={value}; the simulated device count must be a positive integer"
            )


def start_backend() -> None:
    """Start JAX's devices; ConfigError naming ``JAX_PLATFORMS`` when that platform cannot start
    (``JAX_PLATFORMS=cuda`` without a GPU is a bare AssertionError inside JAX)."""
    import jax

    from meshdsl.errors import ConfigError

    try:
        jax.devices()
    except (RuntimeError, AssertionError) as e:
        platforms = os.environ.get("JAX_PLATFORMS")
        why = str(e).splitlines()[0] if str(e).strip() else "it has no plugin or no device here"
        named = f"JAX_PLATFORMS={platforms!r}: " if platforms else ""
        raise ConfigError(
            f"{named}JAX could not start its devices ({why}); unset JAX_PLATFORMS or set it to cpu"
        ) from None
