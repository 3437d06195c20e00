"""README.md runs as written: every fenced block is run, checked, or skipped with its reason in the README.

The line just above each block's fence is its marker, an HTML comment (invisible on GitHub,
plain in the source) that says what the test does with each of the block's lines::

    <!-- test: CLAUSE | CLAUSE | ... -->

A block's lines are its commands (a ``\\``-continued command is one line; blank lines do not
count), a ``console`` block's ``$`` commands, or a ``text`` block's output lines; a ``python`` or
``toml`` block is one line. A CLAUSE names a verb, optionally the lines it applies to (``line 2``,
``lines 1,3-4``; none: every line no other clause names), then optionally substitutions, then
after ``:`` its reason::

    run [LINES] [with `OLD` -> `NEW`, ...]    runs it (`OLD` must occur in each line it applies to)
    check [LINES] [with ...]: REASON          only parses and checks it (``meshdsl.cli.check``:
                                              every mistake that shows before a device is used;
                                              Python: compiled, not run)
    skip [LINES]: REASON                      not run at all (the only verb for another language)
    output of `COMMAND` [with ...]            (a text block) runs COMMAND, which the README must
                                              show in backticks, and holds its output to the lines
    same as `FILE`                            (a toml block) loads to the layout FILE loads to

Every line is named by exactly one clause and every clause names a line; ``check`` and ``skip``
need a reason, and a block with no marker fails. ``run`` is: a ``meshdsl`` command through
``meshdsl.cli.main`` in this process (its 8 simulated devices; exit status 0, or 2 where a
console block shows ``meshdsl ...: error:``), a Python block ``exec``-ed, a toml block loaded as
a layout. Shown output (a console block's, an ``output of`` block's) must be printed, in order,
numbers read as placeholders (tests/doc_blocks.py, as for docs/tutorial.md). Anything but a
``meshdsl`` command (pip, pytest, ruff) can only be skipped. Everything runs in one temporary
folder holding what a clone and the docs give a reader: the repository's ``layouts/``,
docs/tutorial.md's files (``my_model.py``, ...), ``tokens.npy`` (a token file of the tiny
Transformer's vocab) and ``notes.txt`` (the file the README's mistake writes a checkpoint to).
"""

from __future__ import annotations

import dataclasses
import glob
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
from doc_blocks import Block, blocks, first_missing, sessions

import meshdsl as md
from meshdsl import cli, commands

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TUTORIAL = ROOT / "docs" / "tutorial.md"
_MARKER = re.compile(r"^<!-- test: (.*) -->$")
_CLAUSE = re.compile(
    r"^(?P<verb>run|check|skip|output of `(?P<command>[^`]+)`|same as `(?P<file>[^`]+)`)"
    r"(?: lines? (?P<lines>[\d,\-]+))?"
    r"(?: with (?P<subs>`[^`]*` -> `[^`]*`(?:, `[^`]*` -> `[^`]*`)*))?"
    r"(?:: (?P<reason>.+))?$"
)
_SUB = re.compile(r"`([^`]*)` -> `([^`]*)`")
_RUNS = ("bash", "sh", "console", "python", "toml")  # the languages a block can run in


@dataclasses.dataclass(frozen=True)
class Clause:
    """One clause of a marker: its verb, the lines it names (None: the rest), substitutions, reason."""

    verb: str
    lines: frozenset[int] | None
    subs: tuple[tuple[str, str], ...]
    reason: str
    command: str = ""
    file: str = ""

    def apply(self, line: str) -> str:
        """``line`` with this clause's substitutions made; each must apply."""
        for old, new in self.subs:
            assert old in line, f"the substitution `{old}` -> `{new}` does not apply to {line!r}"
            line = line.replace(old, new)
        return line


@dataclasses.dataclass(frozen=True)
class Step:
    """What the test does with one line of a block: the line, its clause, and the output it must print."""

    line: str
    clause: Clause
    shown: tuple[str, ...] = ()


def _numbers(spec: str) -> frozenset[int]:
    """``1,3-4`` as {1, 3, 4}."""
    out: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        out.update(range(int(first), int(last or first) + 1))
    return frozenset(out)


def clauses(block: Block) -> list[Clause]:
    """The clauses of ``block``'s marker; AssertionError naming the README line where it has none or a bad one."""
    where = f"README.md:{block.line}"
    marker = _MARKER.match(block.above)
    assert marker, (
        f"{where}: a ```{block.lang} block with no `<!-- test: ... -->` line just above it "
        "(tests/test_readme.py says what it may say)"
    )
    out = []
    for text in marker.group(1).split(" | "):
        m = _CLAUSE.match(text.strip())
        assert m, f"{where}: cannot read the marker's clause {text!r}"
        verb = m.group("verb").split()[0]
        assert verb not in ("check", "skip") or m.group("reason"), f"{where}: `{text}` gives no reason"
        subs = tuple(_SUB.findall(m.group("subs") or ""))
        lines = _numbers(m.group("lines")) if m.group("lines") else None
        out.append(Clause(verb, lines, subs, m.group("reason") or "", m.group("command") or "", m.group("file") or ""))
    return out


def _units(block: Block) -> list[tuple[str, tuple[str, ...]]]:
    """The lines of ``block`` a clause can name, each with the output shown after it."""
    if block.lang in ("bash", "sh"):
        joined = block.text.replace("\\\n", " ")
        return [(line.strip(), ()) for line in joined.splitlines() if line.strip()]
    if block.lang == "console":
        return [(command, tuple(shown)) for command, shown in sessions(block.text)]
    if block.lang == "text":
        return [(line, ()) for line in block.text.splitlines() if line.strip()]
    return [(block.text, ())]


def plan(block: Block) -> list[Step]:
    """Each line of ``block`` with the one clause that names it (a ``same as`` clause names none)."""
    where = f"README.md:{block.line}"
    found = clauses(block)
    units = _units(block)
    named = [c for c in found if c.verb != "same"]
    assert all(c.verb != "same" or block.lang == "toml" for c in found), f"{where}: `same as` is for toml blocks"
    explicit = [n for c in named if c.lines for n in c.lines]
    assert len(explicit) == len(set(explicit)), f"{where}: a line is named by two clauses"
    assert set(explicit) <= set(range(1, len(units) + 1)), f"{where}: the block has {len(units)} lines, not {explicit}"
    rest = [c for c in named if c.lines is None]
    assert len(rest) <= 1, f"{where}: two clauses claim every line left"
    steps = []
    for number, (line, shown) in enumerate(units, 1):
        owner = next((c for c in named if c.lines and number in c.lines), rest[0] if rest else None)
        assert owner, f"{where}: no clause names line {number} ({line[:60]!r})"
        if block.lang == "text" or owner.verb == "output":
            assert block.lang == "text" and owner.verb in ("output", "skip"), (
                f"{where}: a text block's lines are output: `output of` or `skip`"
            )
        elif owner.verb in ("run", "check"):
            assert block.lang in _RUNS, f"{where}: a ```{block.lang} block cannot run: `skip` it with a reason"
            assert block.lang not in ("bash", "sh", "console") or line.startswith("meshdsl "), (
                f"{where}: only meshdsl commands run or are checked: {line!r}"
            )
        steps.append(Step(line, owner, shown))
    idle = [c for c in named if not any(s.clause is c for s in steps)]
    assert not idle, f"{where}: the clause `{idle[0].verb}` names no line"
    return steps


def readme_blocks() -> list[Block]:
    return blocks(README)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A reader's folder: the repository's layouts, the tutorial's files and a tiny token file."""
    root = tmp_path_factory.mktemp("readme")
    (root / "layouts").symlink_to(ROOT / "layouts")
    for b in blocks(TUTORIAL):
        if b.lang in ("python", "toml") and b.name:
            (root / b.name).write_text(b.text)
    np.save(root / "tokens.npy", np.arange(4096, dtype=np.int32) % 64)
    (root / "notes.txt").write_text("")
    return root


def argv(command: str, cwd: Path) -> list[str]:
    """A ``meshdsl`` command line's arguments after ``meshdsl``, its comment dropped and globs expanded in ``cwd``."""
    out = []
    for word in shlex.split(command, comments=True)[1:]:
        matches = sorted(glob.glob(word, root_dir=cwd)) if "*" in word else []
        out.extend(matches or [word])
    return out


def run_command(command: str, shown: tuple[str, ...], cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Run one meshdsl command in this process; its exit status and its output as the README shows them."""
    code = cli.main(argv(command, cwd))
    out, err = capsys.readouterr()
    printed = out + err
    want = 2 if any(re.match(r"meshdsl [\w-]+: error: ", line) for line in shown) else 0
    assert code == want, f"$ {command}\nexit status {code}, not {want}:\n{printed}"
    missing = first_missing(printed, list(shown))
    assert missing is None, f"$ {command}\nprints no line like the README's {missing!r}; it printed:\n{printed}"


def check_command(command: str, cwd: Path) -> None:
    """Parse one meshdsl command and run its check: every mistake that shows before a device is used."""
    try:
        args = commands.parser().parse_args(argv(command, cwd))
    except SystemExit as e:
        raise AssertionError(f"$ {command}\ndoes not parse (exit status {e.code})") from None
    try:
        cli.check(args)
    except md.errors.MeshDslError as e:
        raise AssertionError(f"$ {command}\nis refused: {e}") from None


def run_block(block: Block, cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Everything ``block``'s marker asks for, in ``cwd`` (the current folder)."""
    assert Path.cwd() == cwd, f"run a block from its folder {cwd}, not {Path.cwd()}"
    steps = plan(block)
    outputs = [s for s in steps if s.clause.verb == "output"]
    if outputs:
        command = outputs[0].clause.apply(outputs[0].clause.command)
        run_command(command, tuple(s.line for s in outputs), cwd, capsys)
    for step in steps:
        if step.clause.verb not in ("run", "check"):
            continue
        line = step.clause.apply(step.line)
        if block.lang == "python":
            program = compile(line, f"README.md:{block.line}", "exec")
            if step.clause.verb == "run":
                exec(program, {"__name__": "__main__"})
                capsys.readouterr()
        elif block.lang == "toml":
            (cwd / "block.toml").write_text(line)
            md.Layout.load(cwd / "block.toml")
        elif step.clause.verb == "check":
            check_command(line, cwd)
        else:
            run_command(line, step.shown, cwd, capsys)
    for clause in clauses(block):
        if clause.verb == "same":
            assert md.Layout.load(cwd / "block.toml") == md.Layout.load(ROOT / clause.file), (
                f"README.md:{block.line}: the toml block is not the layout {clause.file}"
            )


def test_every_block_says_what_the_test_does_with_each_line() -> None:
    found = readme_blocks()
    assert len(found) >= 16, f"{len(found)} blocks"
    text = README.read_text()
    for block in found:
        plan(block)
        for clause in clauses(block):
            assert not clause.command or f"`{clause.command}`" in text, (
                f"README.md:{block.line}: the README does not show `{clause.command}`, whose output the block is"
            )


@pytest.mark.parametrize("block", readme_blocks(), ids=lambda b: f"line{b.line}-{b.lang or 'plain'}")
def test_the_readme_block_runs_as_marked(
    block: Block, folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    steps = plan(block)
    if all(s.clause.verb == "skip" for s in steps):
        pytest.skip(f"README.md:{block.line}: {steps[0].clause.reason}")
    monkeypatch.chdir(folder)
    run_block(block, folder, capsys)


# ---- the checker fails where a block drifts ------------------------------------------------------------------------

_DOC = """\
<!-- test: output of `meshdsl train --model mlp --preset tiny --checkpoint-dir notes.txt` -->
```text
meshdsl train: error: --checkpoint-dir 'notes.txt': 'notes.txt' is a file, so the directory cannot be created
```

<!-- test: run line 1 with `--steps 50` -> `--steps 2` | skip: needs a GPU -->
```bash
meshdsl train --model mlp --steps 50
meshdsl gpu-check
```

```bash
meshdsl train --model mlp
```
"""


def test_a_block_with_no_marker_a_bad_clause_or_an_unnamed_line_fails() -> None:
    text, bare = blocks(_DOC)[1], blocks(_DOC)[2]
    steps = plan(text)
    assert [s.clause.verb for s in steps] == ["run", "skip"]
    assert steps[0].clause.apply(steps[0].line) == "meshdsl train --model mlp --steps 2"
    with pytest.raises(AssertionError, match="no `<!-- test: ... -->` line just above"):
        plan(bare)
    with pytest.raises(AssertionError, match="gives no reason"):
        plan(dataclasses.replace(text, above="<!-- test: run line 1 | skip -->"))
    with pytest.raises(AssertionError, match="no clause names line 2"):
        plan(dataclasses.replace(text, above="<!-- test: run line 1 -->"))
    with pytest.raises(AssertionError, match="does not apply"):
        steps[0].clause.apply("meshdsl train --model mlp --steps 5")
    with pytest.raises(AssertionError, match="only meshdsl commands"):
        plan(dataclasses.replace(text, text="pip install meshdsl\nmeshdsl gpu-check\n"))
    with pytest.raises(AssertionError, match="names no line"):
        plan(dataclasses.replace(text, above="<!-- test: run lines 1-2 | skip: needs a GPU -->"))
    with pytest.raises(AssertionError, match="cannot run"):
        plan(dataclasses.replace(text, lang="yaml", above="<!-- test: run -->"))


def test_a_changed_word_in_shown_output_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("")
    output = blocks(_DOC)[0]
    run_block(output, tmp_path, capsys)
    changed = output.text.replace("is a file", "is a folder")
    with pytest.raises(AssertionError, match="prints no line like the README's"):
        run_block(dataclasses.replace(output, text=changed), tmp_path, capsys)
