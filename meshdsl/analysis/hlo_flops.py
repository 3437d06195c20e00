"""Matmul FLOPs a compiled program runs per device, read from its HLO text (loops times their trip counts).

XLA's ``compiled.cost_analysis()`` counts a ``while`` body once whatever its trip count, so a
pipeline's tick loop would look as cheap at 16 microbatches as at 4. This reader walks the
program as :mod:`meshdsl.analysis.hlo` does for collectives: a loop body counts ``known_trip_count``
times, a called or fused computation once per call, and a ``conditional`` its costliest
branch (the most any device runs: under a pipeline a branch runs on some stages only).
Counted: ``dot`` at 2 FLOPs per multiply-add (convolutions are not: the pipelines this serves
have none). A loop without a known trip count that runs a dot is a ``ValueError``.
"""

from __future__ import annotations

import math
import re

from meshdsl.analysis.hlo import (
    _ARRAY,
    _COMMENT,
    _COMPUTATION,
    _INSTRUCTION,
    _OPCODE,
    _TRIP_COUNT,
    _attribute,
    _balanced_end,
    _callees,
    _parse,
)


def _dims(shape: str) -> list[int]:
    """The dimensions of the (first) array type in ``shape``."""
    found = _ARRAY.search(shape)
    return [int(d.removeprefix("<=")) for d in found.group(2).split(",") if d] if found else []


def _operands(text: str) -> list[str]:
    """Operand names of an instruction's text ``TYPE opcode(operands), attributes``."""
    type_end = _balanced_end(text, 0, stop_at_space=True)
    opcode = _OPCODE.match(text, type_end)
    if opcode is None:
        raise ValueError(f"no opcode after the type in HLO instruction {text!r}")
    inner = text[opcode.end() : _balanced_end(text, opcode.end() - 1) - 1]
    return [part.strip().split()[-1].lstrip("%") for part in inner.split(",") if part.strip()]


def matmul_flops(hlo_text: str) -> float:
    """FLOPs of the ``dot``\\ s and ``convolution``\\ s one execution of ``hlo_text``'s entry runs, per device."""
    computations, entry = _parse(hlo_text)
    texts = _texts(hlo_text)
    cache: dict[str, float] = {}

    def walk(name: str) -> float:
        if name not in cache:
            types = {i.name: i.result_type for i in computations[name]}
            total = 0.0
            for i in computations[name]:
                if i.opcode == "dot":
                    lhs = _dims(types.get(_operands(texts[name][i.name])[0], ""))
                    contract = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", i.attributes)
                    k = math.prod(lhs[int(d)] for d in contract.group(1).split(",") if d) if contract else 1
                    total += 2.0 * math.prod(_dims(i.result_type)) * k
                elif i.opcode == "conditional":
                    total += max((walk(c) for c, _ in _callees(i, lambda _: [])), default=0.0)
                elif i.opcode == "while":
                    trip, body = _TRIP_COUNT.search(i.attributes), walk(_attribute(i.attributes, "body"))
                    if trip is None and body:
                        raise ValueError(f"while loop %{i.name} runs dots but has no known_trip_count")
                    total += body * (int(trip.group(1)) if trip else 0)
                else:
                    total += sum(walk(c) * n for c, n in _callees(i, lambda _: []))
            cache[name] = total
        return cache[name]

    return walk(entry)


def _texts(hlo_text: str) -> dict[str, dict[str, str]]:
    """Each computation's instructions' full text (after ``name =``), by name: their operands."""
    out: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for line in _COMMENT.sub("", hlo_text).splitlines():
        if current is None:
            header = _COMPUTATION.match(line)
            if header:
                current = out[header.group(2)] = {}
        elif line.startswith("}"):
            current = None
        elif match := _INSTRUCTION.match(line):
            current[match.group(1)] = match.group(2)
    return out
