"""The commands wing (meshdsl/commands/): a new command is one file, every command is listed with
its help, and the flags several commands share are defined once.

Cheap: nothing is traced or compiled; the new command runs through ``meshdsl.cli.main`` in this
process (its 8 simulated devices from tests/conftest.py).
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest

import meshdsl.commands
from meshdsl.cli import main

PACKAGE = Path(meshdsl.__file__).parent
SHIPPED = [
    "train",
    "export",
    "bench",
    "generate",
    "explain",
    "calibrate",
    "search",
    "gpu-check",
    "lab-digits",
    "launch",
]
"""Every command meshdsl ships, in the order ``meshdsl --help`` lists them."""


def _blocks(doc: str) -> tuple[str, list[str]]:
    """The registry docstring's worked example: the file ``hello.py`` and the console session after it."""
    lines = doc.splitlines()
    start = lines.index(
        "Adding a command is one file. Every module here that defines ``COMMAND`` is a command, listed in"
    )
    code_from = next(i for i in range(start, len(lines)) if lines[i].endswith("hello.py``::")) + 1
    code_to = next(i for i in range(code_from, len(lines)) if lines[i].startswith("is the whole of"))
    session_to = next(i for i in range(code_to + 1, len(lines)) if lines[i].startswith("(the second"))
    code = textwrap.dedent("\n".join(lines[code_from:code_to]))
    session = [line.strip() for line in lines[code_to + 1 : session_to] if line.strip()]
    return code, session


@pytest.fixture
def hello(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The docstring's ``hello.py`` as one more file of the wing (a folder added to the package's path)."""
    code, _ = _blocks(meshdsl.commands.__doc__ or "")
    (tmp_path / "hello.py").write_text(code)
    monkeypatch.setattr(meshdsl.commands, "__path__", [*meshdsl.commands.__path__, str(tmp_path)])
    yield
    sys.modules.pop("meshdsl.commands.hello", None)


def test_a_new_command_is_one_file_and_runs_as_its_docstring_shows(hello: None, capsys) -> None:
    _, session = _blocks(meshdsl.commands.__doc__ or "")
    assert jax.device_count() == 8, "the docstring's session shows 8 devices, the command line's default"
    runs = [i for i, line in enumerate(session) if line.startswith("$ ")]
    assert len(runs) == 2, session
    for i, end in zip(runs, [*runs[1:], len(session)], strict=True):
        argv = session[i].split()[2:]
        code = main(argv)
        out, err = capsys.readouterr()
        shown = "\n".join(session[i + 1 : end])
        if argv[-1] == "0":
            assert (code, out, err.strip()) == (2, "", shown), (argv, code, out, err)
        else:
            assert (code, out.strip(), err) == (0, shown, ""), (argv, code, out, err)
    assert session[-1] == "meshdsl hello: error: --times 0: greet at least once"


def test_the_new_command_is_listed_with_its_help_and_flags(hello: None, capsys) -> None:
    with pytest.raises(SystemExit) as exit_main:
        main(["--help"])
    listing = capsys.readouterr().out
    assert exit_main.value.code == 0 and re.search(r"^\s+hello\s+greet the devices$", listing, re.M), listing
    with pytest.raises(SystemExit) as exit_hello:
        main(["hello", "--help"])
    assert exit_hello.value.code == 0 and "--times TIMES  how often to greet" in capsys.readouterr().out


def test_every_command_has_help_and_is_in_meshdsl_help(capsys) -> None:
    found = meshdsl.commands.commands()
    assert list(found) == SHIPPED
    with pytest.raises(SystemExit):
        main(["--help"])
    listing = " ".join(capsys.readouterr().out.split())
    assert "{" + ",".join(SHIPPED) + "}" in listing, listing
    for name, command in found.items():
        assert command.name == name and command.help.strip(), name
        assert f"{name} {' '.join(command.help.split())}" in listing, name
        with pytest.raises(SystemExit) as exit_command:
            main([name, "--help"])
        usage = capsys.readouterr().out
        assert exit_command.value.code == 0 and usage.startswith(f"usage: meshdsl {name} "), usage


def test_two_modules_cannot_give_one_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "train_again.py").write_text(
        "from meshdsl.commands import Command\n"
        "COMMAND = Command('train', 'a second train', lambda parser: None, lambda args, config: None)\n"
    )
    monkeypatch.setattr(meshdsl.commands, "__path__", [*meshdsl.commands.__path__, str(tmp_path)])
    try:
        with pytest.raises(TypeError, match="define the command 'train'"):
            meshdsl.commands.commands()
    finally:
        sys.modules.pop("meshdsl.commands.train_again", None)


SHARED_FLAGS = ["--model", "--preset", "--set", "--layout", "--optimizer", "--backend", "--profile"]


def test_shared_flags_are_defined_once_and_only_the_entry_points_import_cli() -> None:
    # python -m meshdsl.planner.validate is a developer's script with its own parser and defaults, not a command.
    sources = {p: p.read_text() for p in PACKAGE.rglob("*.py") if p != PACKAGE / "planner" / "validate.py"}
    for flag in [*SHARED_FLAGS, "--grad-reduce-dtype"]:
        defining = sorted(str(p.relative_to(PACKAGE)) for p, text in sources.items() if f'"{flag}",' in text)
        assert defining == ["commands/flags.py"], (flag, defining)
    importing = [
        p for p, text in sources.items() if re.search(r"^\s*(from meshdsl\.cli |from meshdsl import cli)", text, re.M)
    ]
    assert importing == [PACKAGE / "__main__.py"], importing  # python -m meshdsl: the entry point too


def test_python_dash_m_meshdsl_is_the_meshdsl_command(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "meshdsl", "gpu-check", "--out", "report.txt"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.startswith("meshdsl gpu-check: error: --out 'report.txt': the report is markdown"), done.stderr
    assert list(tmp_path.iterdir()) == []
