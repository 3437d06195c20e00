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

A permute is the one collective whose devices need not all send: only the sources of its
pairs do (a pipeline's warm-up sends from its first stage alone). Totals over several
collectives are therefore taken per device and the busiest device's reported
(:func:`busiest_device`): with every device sending, that is the plain sum.

This module is the only place that formula lives: ``md.explain`` (from the traced program),
the HLO reader (from the compiled program) and the planner all call :func:`bytes_moved`, so
their figures agree to the last byte.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable


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


def busiest_device(sends: Iterable[tuple[float, frozenset[int] | None]]) -> float:
    """The most bytes any one device sends over ``sends``: pairs of the bytes each sending device sends
    and which devices send (their partition ids; None: every device)."""
    everyone = 0.0
    per_device: dict[int, float] = {}
    for nbytes, senders in sends:
        if senders is None:
            everyone += nbytes
        else:
            for d in senders:
                per_device[d] = per_device.get(d, 0.0) + nbytes
    return everyone + max(per_device.values(), default=0.0)
