"""The fenced blocks of a Markdown doc, and a check that printed output holds the lines a doc shows.

Shared by tests/test_tutorial.py and tests/test_readme.py. A shown line holds when a printed line
has its shape: numbers read as placeholders (times and losses differ from run to run; words,
units, layouts, dims and the order of lines must not), runs of spaces as one and of dashes as two.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

_BLOCK = re.compile(r"^```(\w*)[ \t]*(\S*)\n(.*?)^```$", re.M | re.S)
_NUMBER = re.compile(r"[-+]?\d[\d,]*(\.\d+)?(e[-+]?\d+)?")


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced block: its language (``""`` for none), file name (``""`` for none), text, the
    line just above its fence and the line number of the fence (1-based)."""

    lang: str
    name: str
    text: str
    above: str
    line: int


def blocks(doc: Path | str) -> list[Block]:
    """Every fenced block of ``doc`` (a path, or the Markdown text itself), in order."""
    text = doc.read_text() if isinstance(doc, Path) else doc
    out = []
    for m in _BLOCK.finditer(text):
        before = text[: m.start()].splitlines()
        out.append(Block(m.group(1), m.group(2), m.group(3), before[-1] if before else "", len(before) + 1))
    return out


def sessions(text: str) -> list[tuple[str, list[str]]]:
    """A console block as (command, the output lines shown after it)."""
    out: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            out.append((line[2:], []))
        else:
            assert out, f"output before any command in a console block: {line!r}"
            out[-1][1].append(line)
    return out


def shape(line: str) -> str:
    """A line with its numbers as ``#``, its runs of spaces as one and of dashes as two (a table's
    column widths follow its numbers)."""
    return " ".join(re.sub(r"-{2,}", "--", _NUMBER.sub("#", line)).split())


def first_missing(printed: str, shown: list[str]) -> str | None:
    """The first shown line (from its first) that the printed output lacks, in order, or None."""
    lines = iter(shape(line) for line in printed.splitlines())
    for line in shown:
        if line.strip() and shape(line) not in lines:
            return line
    return None
