"""Moved to :mod:`meshdsl.measure.fits` (shared by bench, the planner and train); this path stays for code
that imports it from here."""

from meshdsl.measure.fits import (
    ENV,
    Capacity,
    DoesNotFit,
    capacity,
    check,
    is_out_of_memory,
    message,
    readable,
    remedies,
    run_time_message,
)

__all__ = [
    "ENV",
    "Capacity",
    "DoesNotFit",
    "capacity",
    "check",
    "is_out_of_memory",
    "message",
    "readable",
    "remedies",
    "run_time_message",
]
