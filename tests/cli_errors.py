"""What the bad-input tests check of a command that refused its input: one error line, no traceback,
and nothing on disk changed."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any


def snapshot(root: Path) -> dict[str, Any]:
    """Every file's bytes and every directory under ``root``, by relative path."""
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def one_error_line(err: str, *expected: str) -> str:
    """The single ``meshdsl <command>: error: ...`` line of ``err``, holding each of ``expected``; no traceback."""
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert re.match(r"meshdsl (train|bench|explain|calibrate|search|launch|generate): error: \S", lines[0]), err
    for text in expected:
        assert text in lines[0], (text, lines[0])
    return lines[0]
