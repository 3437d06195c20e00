"""Moved to :mod:`meshdsl.measure.timing` (shared by bench, the planner and train); this path stays for code
that imports it from here."""

from meshdsl.measure.timing import (
    CompiledStep,
    abstract_like,
    abstract_state,
    compile_abstract,
    compile_checked,
    compile_step,
    interleaved_rounds,
    losses_from,
    memory_bytes,
    round_orders,
)

__all__ = [
    "CompiledStep",
    "abstract_like",
    "abstract_state",
    "compile_abstract",
    "compile_checked",
    "compile_step",
    "interleaved_rounds",
    "losses_from",
    "memory_bytes",
    "round_orders",
]
