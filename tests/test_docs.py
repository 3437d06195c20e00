"""The docs name everything public: docs/api.md every public name and command, README.md every shipped layout.

Cheap: it imports the package and reads the argparse parser; nothing is traced or compiled.
"""

import argparse
import inspect
import re
from pathlib import Path

import meshdsl
import meshdsl.checkpoint
import meshdsl.model.config
import meshdsl.model.loader
import meshdsl.model.protocol
import meshdsl.pipeline
import meshdsl.pipeline.config
import meshdsl.planner
import meshdsl.planner.roles
import meshdsl.runtime.distributed
import meshdsl.runtime.launch
import meshdsl.runtime.layout_spec
from meshdsl import cli

ROOT = Path(__file__).resolve().parents[1]
MODULES = [
    meshdsl.checkpoint,
    meshdsl.pipeline,
    meshdsl.pipeline.config,
    meshdsl.runtime.distributed,
    meshdsl.runtime.launch,
    meshdsl.model.loader,
    meshdsl.model.protocol,
    meshdsl.runtime.layout_spec,
    meshdsl.model.config,
    meshdsl.planner.roles,
]


def _mentioned(name: str, text: str) -> bool:
    """Whether ``name`` appears in ``text`` as a whole word (not as part of a longer identifier)."""
    return re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", text) is not None


def _package_names() -> list[str]:
    if hasattr(meshdsl, "__all__"):
        return list(meshdsl.__all__)
    return [n for n, v in vars(meshdsl).items() if not n.startswith("_") and not inspect.ismodule(v)]


def _defined_here(module) -> list[str]:
    """Public functions and classes defined in ``module`` itself (not imported into it); a package's ``__all__``."""
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and (inspect.isfunction(value) or inspect.isclass(value))
        and value.__module__ == module.__name__
    ]


def _commands() -> list[str]:
    parser = cli._parser()
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert subparsers, "the meshdsl parser has no subcommands"
    return [name for action in subparsers for name in action.choices]


def public_names() -> dict[str, list[str]]:
    """Where each name comes from -> the names that docs/api.md must mention."""
    names = {"meshdsl": _package_names()}
    for module in MODULES:
        names[module.__name__] = _defined_here(module)
    names["meshdsl.planner"] = list(
        getattr(meshdsl.planner, "__all__", [n for n in vars(meshdsl.planner) if not n.startswith("_")])
    )
    # A subcommand counts as documented when api.md shows it as a command: ``meshdsl <name>``.
    names["meshdsl (command)"] = [f"meshdsl {name}" for name in _commands()]
    return names


def test_every_public_name_is_in_the_api_docs():
    text = (ROOT / "docs" / "api.md").read_text()
    groups = public_names()
    assert all(groups.values()), f"found no names for {[k for k, v in groups.items() if not v]}"
    missing = [f"{where}: {name}" for where, names in groups.items() for name in names if not _mentioned(name, text)]
    assert not missing, "docs/api.md does not mention:\n  " + "\n  ".join(missing)


def test_every_shipped_layout_is_in_the_readme():
    text = (ROOT / "README.md").read_text()
    stems = sorted(p.stem for p in (ROOT / "layouts").glob("*.toml"))
    assert stems, "no layouts/*.toml found"
    missing = [s for s in stems if not _mentioned(s, text)]
    assert not missing, f"README.md does not mention the shipped layouts {missing}"


def test_ci_runs_the_readme_test_and_lint_commands():
    """`.ci/run` runs exactly what the README tells a newcomer to run: the tests, then lint and types."""
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_line = 'pip install -e ".[test]" && python -m pytest'
    lint_line = "ruff format --check . && ruff check . && mypy"
    assert test_line in readme and lint_line in readme
    assert 'pip install -q -e ".[test]"' in ci and "python -m pytest" in ci
    assert lint_line in ci, f".ci/run does not run the README's lint line {lint_line!r}"
