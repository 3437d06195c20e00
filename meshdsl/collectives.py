"""The collectives meshdsl emits, and what each one costs.

Bytes moved per device follow the ring model, with ``S`` the buffer bytes and ``n`` the
number of devices in the group:

=================  ======================  ===========================
collective         bytes per device        ``S`` is
=================  ======================  ===========================
all-reduce         ``2 (n - 1) / n * S``   the (equal) input/output
all-gather         ``(n - 1) / n * S``     the gathered output
reduce-scatter     ``(n - 1) / n * S``     the full input
all-to-all         ``(n - 1) / n * S``     the (equal) input/output
collective-permute ``S``                   the sent buffer
=================  ======================  ===========================

This module is the only place that formula lives: ``md.explain`` (from the traced program),
the HLO reader (from the compiled program) and the planner all call :func:`bytes_moved`, so
their figures agree to the last byte.
"""

from __future__ import annotations

import enum

GRAD_REDUCE_DTYPES = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
"""The dtypes a gradient sum can be compressed to (``--grad-reduce-dtype``; :mod:`meshdsl.compression`)."""


class Collective(enum.Enum):
    """A collective operation, named as in XLA's HLO."""

    ALL_REDUCE = "all-reduce"
    ALL_GATHER = "all-gather"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_TO_ALL = "all-to-all"
    COLLECTIVE_PERMUTE = "collective-permute"


def bytes_moved(collective: Collective, buffer_bytes: float, group_size: int) -> float:
    """Bytes one device sends for ``collective`` on a buffer of ``buffer_bytes`` over ``group_size`` devices."""
    n = group_size
    if collective is Collective.COLLECTIVE_PERMUTE:
        return float(buffer_bytes)
    if n <= 1:
        return 0.0
    if collective is Collective.ALL_REDUCE:
        return 2.0 * (n - 1) * buffer_bytes / n
    return (n - 1) * buffer_bytes / n
