"""The ring model's one function, checked against the paper formulas, and kept the only copy.

References: Patarasuk & Yuan (2009) and NCCL's performance notes: a ring all-reduce of ``B``
bytes over ``n`` devices sends ``2 (n - 1) / n * B`` per device; an all-gather or reduce-scatter
``(n - 1) / n`` of the full (gathered / scattered) buffer; an all-to-all ``(n - 1) / n`` of its
buffer (each device keeps one of its ``n`` blocks); a permute sends its buffer once.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from fractions import Fraction
from pathlib import Path

import meshdsl.models
import pytest

import meshdsl
from meshdsl.collectives import Collective, bytes_moved, input_bytes, priced_buffer

GROUPS = (1, 2, 3, 4, 6, 8)
BUFFERS = (4, 96, 4096, 12_345 * 8)


@pytest.mark.parametrize("n", GROUPS)
@pytest.mark.parametrize("b", BUFFERS)
def test_each_collective_against_the_paper(n: int, b: int) -> None:
    assert bytes_moved(Collective.ALL_REDUCE, b, b, n) == Fraction(2 * b * (n - 1), n)
    assert bytes_moved(Collective.ALL_GATHER, b, b * n, n) == Fraction(b * n * (n - 1), n)
    assert bytes_moved(Collective.REDUCE_SCATTER, b * n, b, n) == Fraction(b * n * (n - 1), n)
    assert bytes_moved(Collective.ALL_TO_ALL, b, b, n) == Fraction(b * (n - 1), n)
    assert bytes_moved(Collective.COLLECTIVE_PERMUTE, b, b, n) == b
    assert bytes_moved(Collective.COLLECTIVE_PERMUTE, b, b, 0) == b  # HLO pairs that name no device


def test_exact_where_floats_are_not() -> None:
    # 3 devices, 4 bytes: 16/3 exactly; three of them sum to 16, not 16.000000000000004.
    one = bytes_moved(Collective.ALL_REDUCE, 4, 4, 3)
    assert isinstance(one, Fraction) and one == Fraction(16, 3) and 3 * one == 16


def test_input_bytes_from_the_output() -> None:
    assert input_bytes(Collective.ALL_GATHER, 256, 4) == 64
    assert input_bytes(Collective.ALL_GATHER, 3, 2) == Fraction(3, 2)  # an odd-sized HLO output
    assert input_bytes(Collective.REDUCE_SCATTER, 64, 4) == 256
    assert input_bytes(Collective.ALL_REDUCE, 64, 4) == input_bytes(Collective.ALL_TO_ALL, 64, 4) == 64
    assert input_bytes(Collective.COLLECTIVE_PERMUTE, 64, 0) == 64


def test_the_priced_buffer_is_the_papers() -> None:
    assert priced_buffer(Collective.ALL_GATHER, 64, 256, 4) == 256  # the gathered output
    assert priced_buffer(Collective.REDUCE_SCATTER, 256, 64, 4) == 256  # the full input
    assert priced_buffer(Collective.ALL_REDUCE, 64, 64, 4) == 64
    assert priced_buffer(Collective.ALL_TO_ALL, 64, 64, 4) == 64
    assert priced_buffer(Collective.COLLECTIVE_PERMUTE, 64, 64, 2) == 64


@pytest.mark.parametrize(
    ("collective", "given", "got", "n"),
    [
        (Collective.ALL_GATHER, 64, 64, 4),  # the input priced as if it were the gathered output
        (Collective.REDUCE_SCATTER, 64, 64, 4),
        (Collective.ALL_REDUCE, 64, 32, 2),
        (Collective.ALL_TO_ALL, 64, 16, 4),
        (Collective.ALL_REDUCE, 64, 64, 0),
    ],
)
def test_buffers_that_do_not_fit_the_collective_are_refused(
    collective: Collective, given: int, got: int, n: int
) -> None:
    with pytest.raises(ValueError, match=f"{collective.value} over {n} devices"):
        bytes_moved(collective, given, got, n)


# ---- no second copy of the formula ---------------------------------------------------------------

_RING = (
    re.compile(r"\(\s*([A-Za-z_]\w*)\s*-\s*1\s*\)[^\n]*?/{1,2}\s*\1\b"),  # (n - 1) / n, (n - 1) * S // n
    re.compile(r"\b1(?:\.0)?\s*-\s*1(?:\.0)?\s*/{1,2}\s*[A-Za-z_]"),  # 1 - 1 / n
    re.compile(r"Fraction\(\s*[^,]*\b([A-Za-z_]\w*)\s*-\s*1\s*,\s*\1\s*\)"),  # Fraction(n - 1, n)
)


def _code(source: str) -> list[tuple[int, str]]:
    """``source``'s lines with strings and comments blanked (docs may quote the formula; code may not)."""
    lines = source.splitlines()
    blank = [list(line) for line in lines]
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in (tokenize.STRING, tokenize.COMMENT):
            (r0, c0), (r1, c1) = token.start, token.end
            for r in range(r0, r1 + 1):
                start = c0 if r == r0 else 0
                end = c1 if r == r1 else len(lines[r - 1])
                blank[r - 1][start:end] = " " * (end - start)
    return [(i + 1, "".join(chars)) for i, chars in enumerate(blank)]


def ring_formulas(source: str, allowed: range = range(0)) -> list[tuple[int, str]]:
    """The code lines of ``source`` outside ``allowed`` that compute a ring-model factor."""
    return [
        (number, line.strip())
        for number, line in _code(source)
        if number not in allowed and any(p.search(line) for p in _RING)
    ]


def _bytes_moved_lines(source: str) -> range:
    tree = ast.parse(source)
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "bytes_moved"]
    return range(fn.lineno, (fn.end_lineno or fn.lineno) + 1)


@pytest.mark.parametrize(
    "line",
    [
        "return (factor * (n - 1) * (m // n) * (m // local_split), 1, 1)",
        "x = 2.0 * (g-1)/g * buffer",
        "moved = buffer * (1 - 1 / n)",
        "f = Fraction(size - 1, size)",
    ],
)
def test_the_search_finds_a_ring_formula(line: str) -> None:
    assert ring_formulas(f"def f():\n    {line}\n") == [(2, line)]


def test_no_ring_formula_outside_bytes_moved() -> None:
    package = Path(meshdsl.__file__).parent
    paths = sorted(package.rglob("*.py")) + sorted(Path(meshdsl.models.__file__).parent.rglob("*.py"))
    found = []
    for path in paths:
        source = path.read_text()
        allowed = _bytes_moved_lines(source) if path == package / "collectives.py" else range(0)
        found += [f"{path}:{n}: {line}" for n, line in ring_formulas(source, allowed)]
    assert not found, "a second copy of the ring model; price it with meshdsl.collectives.bytes_moved:\n" + "\n".join(
        found
    )
    assert ring_formulas((package / "collectives.py").read_text()), "the search no longer sees the one formula"
