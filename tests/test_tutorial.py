"""docs/tutorial.md runs as written: every file it shows is written, every command it shows is run.

From an empty folder outside the repository, as a user follows it: each ```` ```python NAME ````
and ```` ```toml NAME ```` block is written to the file ``NAME``, then each ``$ meshdsl ...`` line
of the ```` ```console ```` blocks runs (``meshdsl.cli.main``, in this process: its 8 simulated
devices, and no import paid per command), in order. Each
must succeed, and its output must hold the lines the tutorial pastes, in order, with every number
read as a placeholder (times and losses differ from run to run; words, units, layouts, dims and
the order of rows must not). Then the layout search wrote must split the model's own dims.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import meshdsl as md
from meshdsl.cli import main

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "docs" / "tutorial.md"
_BLOCK = re.compile(r"^```(\w+)[ \t]*(\S*)\n(.*?)^```$", re.M | re.S)
_NUMBER = re.compile(r"[-+]?\d[\d,]*(\.\d+)?(e[-+]?\d+)?")


def blocks() -> list[tuple[str, str, str]]:
    """Every fenced block of the tutorial: (language, file name or "", text)."""
    return [(m.group(1), m.group(2), m.group(3)) for m in _BLOCK.finditer(TUTORIAL.read_text())]


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


def _shape(line: str) -> str:
    """A line with its numbers as ``#``, its runs of spaces as one and of dashes as two (a table's
    column widths follow its numbers)."""
    return " ".join(re.sub(r"-{2,}", "--", _NUMBER.sub("#", line)).split())


def _holds_in_order(printed: str, shown: list[str]) -> str | None:
    """The first shown line (from its first) that the printed output lacks, in order, or None."""
    lines = iter(_shape(line) for line in printed.splitlines())
    for line in shown:
        if line.strip() and _shape(line) not in lines:
            return line
    return None


def test_the_tutorial_runs_as_written(tmp_path: Path, monkeypatch, capsys) -> None:
    found = blocks()
    files = [(name, text) for lang, name, text in found if lang in ("python", "toml")]
    commands = [s for lang, _, text in found if lang == "console" for s in sessions(text)]
    assert [name for name, _ in files][:1] == ["my_model.py"] and all(name for name, _ in files), files
    assert len(commands) >= 5
    for name, text in files:
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    for command, shown in commands:
        argv = shlex.split(command)
        assert argv[0] == "meshdsl", f"the tutorial's commands are meshdsl commands: {command}"
        code = main(argv[1:])
        out, err = capsys.readouterr()
        printed = out + err
        assert code == 0, f"$ {command}\n{printed}"
        missing = _holds_in_order(printed, shown)
        assert missing is None, f"$ {command}\nprints no line like the tutorial's {missing!r}; it printed:\n{printed}"
    best = md.Layout.load(tmp_path / "best.toml")
    split = set(best.rules) | set(best.params.rules if best.params else {})
    assert split and split <= {"rows", "features", "hidden"}, (
        f"search's best layout splits {split}, not the model's dims"
    )


def test_the_placeholder_reading_catches_a_changed_word() -> None:
    printed = "step  1/20 [#...] loss 1.4880  step 11464.6 ms  3 examples/s\nwrote best.toml"
    assert (
        _holds_in_order(printed, ["step 1/20 [#...] loss 0.9  step 2.0 ms  12,000 examples/s", "wrote best.toml"])
        is None
    )
    assert _holds_in_order(printed, ["step 1/20 [#...] loss 0.9  step 2.0 ms  12,000 tokens/s"]) is not None
    assert (
        _holds_in_order(printed, ["wrote best.toml", "step 1/20 [#...] loss 0.9  step 2.0 ms  3 examples/s"])
        is not None
    )
