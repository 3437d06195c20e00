"""Does a compiled step fit a device's memory? One check for every command that compiles a step.

A compiled program's memory per device is XLA's ``memory_analysis()`` (arguments + outputs +
temporaries - the donated buffers its outputs reuse: :func:`meshdsl.measure.timing.memory_bytes`).
A device's capacity is, in order: the environment variable :data:`ENV` (bytes; to test or to
plan for a smaller device), the device's own allocator limit (``memory_stats()["bytes_limit"]``:
GPUs and TPUs), or on a CPU, which reports none, the host's available memory (``MemAvailable``
of ``/proc/meminfo``) shared by the simulated devices of this process. Where none is known the
check passes silently (nothing to compare with).

A step that does not fit is :class:`DoesNotFit` (a ConfigError: ``train`` exits 2 before its first
step, ``bench`` reports the entry as "does not fit" and goes on), with both numbers and the
remedies. An allocator that still runs out at run time raises XLA's ``RESOURCE_EXHAUSTED``;
:func:`is_out_of_memory` recognises it so the caller reports it the same way.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax

from meshdsl.errors import ConfigError

ENV = "MESHDSL_DEVICE_MEMORY_BYTES"
"""Environment variable: a device's memory in bytes, overriding what the device or host reports."""


@dataclasses.dataclass(frozen=True)
class Capacity:
    """A device's memory in bytes and where that figure comes from (for messages)."""

    bytes: int
    source: str


class DoesNotFit(ConfigError):
    """A compiled step needs more memory per device than a device has."""

    def __init__(self, message: str, needed: int, capacity: Capacity):
        super().__init__(message)
        self.needed = needed
        self.capacity = capacity


def _host_available() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None off Linux)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def capacity(device: Any = None) -> Capacity | None:
    """The memory of ``device`` (default: the first local device), per the module docstring; None where unknown.

    The one reading of a device's memory: this check and ``meshdsl calibrate's`` profile both use it.
    """
    override = os.environ.get(ENV)
    if override is not None:
        try:
            value = int(float(override))
        except (ValueError, OverflowError):  # not a number, NaN, infinity
            raise ConfigError(f"{ENV}={override!r}: it must be a number of bytes, e.g. 24e9") from None
        if value <= 0:
            raise ConfigError(f"{ENV}={override!r}: the memory per device must be a positive number of bytes")
        return Capacity(value, f"{ENV}")
    device = device or jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return Capacity(int(stats["bytes_limit"]), f"the {device.platform} allocator's limit")
    available = _host_available()
    if available is None:
        return None
    count = jax.local_device_count()
    return Capacity(available // count, f"the host's available memory shared by {count} simulated device(s)")


def readable(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps it at least 1, to 3 significant figures
    (``512 B``, ``1.5 KiB``, ``682 GiB``): small figures do not read as ``0``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.3g} {unit}" if value < 999.5 else f"{value:,.0f} {unit}"
    return f"{n:.0f} B"


def remedies(cap: Capacity, remat: bool = False) -> str:
    """What would make a step fit, for the message (``remat``: the model already recomputes its
    activations, so that is not suggested again)."""
    recompute = "" if remat else "recompute activations (--set remat=true where the model has it), "
    return (
        f"to fit: {recompute}a smaller batch (--set batch=N), "
        f"more devices, or a layout `meshdsl search --memory-gb {cap.bytes / 1e9:.3g}` proposes"
    )


def remats(model: object) -> bool:
    """Whether ``model``'s config turns recomputation on (``remat``: True)."""
    return getattr(getattr(model, "config", None), "remat", False) is True


def message(what: str, needed: Mapping[str, int], cap: Capacity, remat: bool = False) -> str:
    """One line: ``what`` needs this much per device (and of what), a device has that much, remedies."""
    parts = " + ".join(f"{k} {readable(needed[k])}" for k in ("arguments", "outputs", "temporaries"))
    if needed.get("aliased"):
        parts += f" - donated {readable(needed['aliased'])}"
    return (
        f"{what} does not fit: it needs {readable(needed['total'])} per device ({parts}) but a device has "
        f"{readable(cap.bytes)} ({cap.source}); {remedies(cap, remat)}"
    )


def check(what: str, needed: Mapping[str, int], cap: Capacity | None = None, remat: bool = False) -> None:
    """Raise :class:`DoesNotFit` when ``needed`` (:func:`meshdsl.measure.timing.memory_bytes`) exceeds
    ``cap`` (default: :func:`capacity` of the first local device); ``remat``: the model recomputes already."""
    cap = cap or capacity()
    if cap is not None and needed["total"] > cap.bytes:
        raise DoesNotFit(message(what, needed, cap, remat), needed["total"], cap)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is XLA's allocator running out (``RESOURCE_EXHAUSTED``) at run time."""
    return "RESOURCE_EXHAUSTED" in str(error) or "Out of memory" in str(error)


def run_time_message(what: str, error: BaseException, cap: Capacity | None = None) -> str:
    """One line for an out-of-memory error at run time (the compiled figure fitted, the allocator did not)."""
    cap = cap or capacity()
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    has = "" if cap is None else f" (a device has {readable(cap.bytes)}, {cap.source})"
    fix = remedies(cap) if cap else "try a smaller batch"
    return f"{what} ran out of memory at run time{has}: {first[:200]}; {fix}"
