"""Moved to :mod:`meshdsl.measure.peaks` (shared by bench, the planner and train); this path stays for code
that imports it from here."""

from meshdsl.measure.peaks import peak_flops

__all__ = ["peak_flops"]
