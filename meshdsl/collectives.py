"""The collectives meshdsl emits, and what each one costs.

Bytes moved per device follow the ring model, with ``n`` the number of devices in the group and
``S`` the buffer the cost counts:

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

This module is the only place that rule lives, both halves of it: which buffer counts and the
formula. :func:`bytes_moved` takes a collective's input and output bytes as the caller sees them
and picks ``S`` itself, so ``md.explain`` (from the traced program), the HLO reader (from the
compiled program), the relayout search, the planner's calibration and bench's floor all agree
to the last byte. tests/test_collectives.py fails if a second copy of the formula appears.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from fractions import Fraction

GRAD_REDUCE_DTYPES = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
"""The dtypes a gradient sum can be compressed to (``--grad-reduce-dtype``; :mod:`meshdsl.compression`)."""


class Collective(enum.Enum):
    """A collective operation, named as in XLA's HLO."""

    ALL_REDUCE = "all-reduce"
    ALL_GATHER = "all-gather"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_TO_ALL = "all-to-all"
    COLLECTIVE_PERMUTE = "collective-permute"


def input_bytes(collective: Collective, out_bytes: int | Fraction, group_size: int) -> Fraction:
    """One device's input bytes of ``collective`` over ``group_size`` devices giving ``out_bytes``: an
    all-gather's output is ``group_size`` times its input, a reduce-scatter's input ``group_size``
    times its output, the others' are equal (for a reader that sees only the output, as of HLO)."""
    if group_size < 1 and collective is not Collective.COLLECTIVE_PERMUTE:  # a permute's price does not need n
        raise ValueError(f"{collective.value} over {group_size} devices: no devices")
    if collective is Collective.ALL_GATHER:
        return Fraction(out_bytes) / group_size
    return Fraction(out_bytes) * (group_size if collective is Collective.REDUCE_SCATTER else 1)


def priced_buffer(
    collective: Collective, in_bytes: int | Fraction, out_bytes: int | Fraction, group_size: int
) -> Fraction:
    """The buffer ``S`` the ring model prices for ``collective`` over ``group_size`` devices (see the table above).

    ``in_bytes`` and ``out_bytes``: one device's input and output buffer of it; a pair that does
    not fit the collective (:func:`input_bytes`) is a ValueError, not a price.
    """
    expected = input_bytes(collective, out_bytes, group_size)
    if Fraction(in_bytes) != expected:
        raise ValueError(
            f"{collective.value} over {group_size} devices cannot give {out_bytes} bytes out from {in_bytes} in"
            f" (it takes {expected})"
        )
    return Fraction(out_bytes if collective is Collective.ALL_GATHER else in_bytes)


def bytes_moved(
    collective: Collective, in_bytes: int | Fraction, out_bytes: int | Fraction, group_size: int
) -> Fraction:
    """Bytes one device sends for ``collective`` over ``group_size`` devices, exactly: the ring model's
    factor times :func:`priced_buffer` of the same arguments."""
    buffer = priced_buffer(collective, in_bytes, out_bytes, group_size)
    if collective is Collective.COLLECTIVE_PERMUTE:
        return buffer
    factor = Fraction(2 * (group_size - 1) if collective is Collective.ALL_REDUCE else group_size - 1, group_size)
    return factor * buffer


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
