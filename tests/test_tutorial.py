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

import shlex
from pathlib import Path

from doc_blocks import blocks, first_missing, sessions

import meshdsl as md
from meshdsl.cli import main

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "docs" / "tutorial.md"


def test_the_tutorial_runs_as_written(tmp_path: Path, monkeypatch, capsys) -> None:
    found = blocks(TUTORIAL)
    files = [(b.name, b.text) for b in found if b.lang in ("python", "toml")]
    commands = [s for b in found if b.lang == "console" for s in sessions(b.text)]
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
        missing = first_missing(printed, shown)
        assert missing is None, f"$ {command}\nprints no line like the tutorial's {missing!r}; it printed:\n{printed}"
    best = md.Layout.load(tmp_path / "best.toml")
    split = set(best.rules) | set(best.params.rules if best.params else {})
    assert split and split <= {"rows", "features", "hidden"}, (
        f"search's best layout splits {split}, not the model's dims"
    )


def test_the_placeholder_reading_catches_a_changed_word() -> None:
    printed = "step  1/20 [#...] loss 1.4880  step 11464.6 ms  3 examples/s\nwrote best.toml"
    assert (
        first_missing(printed, ["step 1/20 [#...] loss 0.9  step 2.0 ms  12,000 examples/s", "wrote best.toml"]) is None
    )
    assert first_missing(printed, ["step 1/20 [#...] loss 0.9  step 2.0 ms  12,000 tokens/s"]) is not None
    assert (
        first_missing(printed, ["wrote best.toml", "step 1/20 [#...] loss 0.9  step 2.0 ms  3 examples/s"]) is not None
    )
