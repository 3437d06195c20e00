"""docs/api.md is the declared public surface, held to the code; README.md names every shipped layout.

A row of api.md's tables names its subject in the first cell (``md.nn.Linear(inputs, ...)``,
``md.reduce_sum, reduce_mean (x, dims=None)``). Every such name must import, every name must belong
to the surface, every public name of the surface must be listed, and no row may run over 800 characters
(detail goes to a docstring or docs/design.md). Cheap: it imports the package and reads the argparse parser.
"""

import argparse
import importlib
import re
from pathlib import Path

import meshdsl
import meshdsl.errors
import meshdsl.model.protocol
import meshdsl.planner
from meshdsl import cli

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api.md"
MAX_ROW = 800

# How a first cell may start a name: the prefix -> the dotted path it stands for.
ALIASES = {
    "md": "meshdsl",
    "planner": "meshdsl.planner",
    "layout": "meshdsl.Layout",
    "model": "meshdsl.model.protocol.Pipelined",
    "CheckpointManager": "meshdsl.checkpoint.CheckpointManager",
    "meshdsl": "meshdsl",
}
# The public surface: a listed name must lie under one of these.
SURFACE = (
    "meshdsl.nn",
    "meshdsl.random",
    "meshdsl.checkpoint",
    "meshdsl.pipeline",
    "meshdsl.planner",
    "meshdsl.model.protocol",
    "meshdsl.errors",
)
SUBPACKAGES = ("nn", "random", "checkpoint", "pipeline")


def _rows(text: str) -> list[str]:
    """The body rows of api.md's tables (not headers, not separators)."""
    return [
        line
        for line in text.splitlines()
        if line.startswith("| ") and not line.startswith("|---") and not re.match(r"\| (name|op|command) \|", line)
    ]


def _drop_calls(span: str) -> str:
    """``f(a, (b, c)) -> T`` without its (nested) parentheses and what follows an arrow."""
    span = span.split(" -> ")[0]
    while True:
        shorter = re.sub(r"\([^()]*\)", "", span)
        if shorter == span:
            return span
        span = shorter


def _owner(dotted: str) -> str:
    """The class a method shorthand (``.release()``) belongs to: the last capitalised part of ``dotted``."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        if parts[cut - 1][:1].isupper():
            return ".".join(parts[:cut])
    return dotted


def listed_names(text: str) -> list[str]:
    """The dotted names the first cells of api.md's rows list, aliases resolved.

    A bare name after a dotted one in the same cell (``md.exp, log``) lives where the dotted one does;
    a method shorthand (``.spec``) belongs to the last class named before it.
    """
    names = []
    for row in _rows(text):
        cells = row[2:].split(" | ")
        # the ops table's family rows (``| binary | `md.add, subtract ...` |``) name them in the second cell
        cell = cells[0] if "`" in cells[0] or len(cells) < 2 else cells[1]
        parent = None
        for span in re.findall(r"`([^`]*)`", cell):
            if span.startswith("meshdsl ") or span.startswith("python "):
                break  # a command line, checked by test_every_command_is_documented
            for token in _drop_calls(span).split(","):
                token = token.strip().removesuffix("\\|").strip()
                if not re.fullmatch(r"\.?[A-Za-z_][\w.]*", token):
                    continue
                head, _, rest = token.partition(".")
                if token.startswith("."):
                    if parent is None:
                        continue
                    name = f"{_owner(parent)}{token}"
                elif head in ALIASES and rest:
                    name = f"{ALIASES[head]}.{rest}"
                elif parent is not None and "." not in token:
                    name = f"{parent.rsplit('.', 1)[0]}.{token}"
                else:
                    continue
                names.append(name)
                parent = name
    return names


def resolve(dotted: str) -> object:
    """The object a dotted name denotes: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            value = _attribute(value, attr)
        return value
    raise ImportError(dotted)


def _attribute(value: object, attr: str) -> object:
    """``value.attr``, or for a class that only declares ``attr`` (a Protocol's or dataclass's annotation) its type."""
    if hasattr(value, attr) or not isinstance(value, type):
        return getattr(value, attr)
    for klass in value.__mro__:
        if attr in getattr(klass, "__annotations__", {}):
            return klass.__annotations__[attr]
    return getattr(value, attr)


def on_surface(dotted: str) -> bool:
    """Whether a listed name belongs to the declared surface."""
    parts = dotted.split(".")
    if dotted.startswith(SURFACE):
        planner_name = dotted.startswith("meshdsl.planner.") and parts[2] not in meshdsl.planner.__all__
        return not planner_name
    return len(parts) >= 2 and parts[1] in meshdsl.__all__


def public_names() -> dict[str, list[str]]:
    """Each public namespace -> its public names, as dotted paths."""
    protocol = meshdsl.model.protocol
    errors = [
        n for n, v in vars(meshdsl.errors).items() if isinstance(v, type) and issubclass(v, meshdsl.errors.MeshDslError)
    ]
    groups = {
        "meshdsl": [n for n in meshdsl.__all__ if n not in SUBPACKAGES],
        "meshdsl.planner": list(meshdsl.planner.__all__),
        "meshdsl.model.protocol": list(protocol.__all__),
        "meshdsl.errors": errors,
    }
    for sub in SUBPACKAGES:
        groups[f"meshdsl.{sub}"] = list(importlib.import_module(f"meshdsl.{sub}").__all__)
    return {where: [f"{where}.{n}" for n in names] for where, names in groups.items()}


def _commands() -> list[str]:
    parser = cli._parser()
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert subparsers, "the meshdsl parser has no subcommands"
    return [name for action in subparsers for name in action.choices]


def test_every_listed_name_imports_and_is_on_the_surface():
    names = listed_names(API.read_text())
    assert len(names) > 100, f"found only {len(names)} names in docs/api.md: the row parser is broken"
    broken = []
    for name in names:
        try:
            resolve(name)
        except (ImportError, AttributeError) as error:
            broken.append(f"{name}: {error}")
    assert not broken, "docs/api.md lists names that do not import:\n  " + "\n  ".join(broken)
    internal = sorted({n for n in names if not on_surface(n)})
    assert not internal, "docs/api.md lists internal names (describe them in docs/design.md):\n  " + "\n  ".join(
        internal
    )


def test_every_public_name_is_documented():
    listed = set(listed_names(API.read_text()))
    groups = public_names()
    assert all(groups.values()), f"found no public names in {[k for k, v in groups.items() if not v]}"
    # md.X is also reachable as meshdsl.<module>.X; a name counts as listed under either path.
    listed_objects = {id(resolve(n)) for n in listed}
    missing = [
        name
        for names in groups.values()
        for name in names
        if name not in listed and id(resolve(name)) not in listed_objects
    ]
    assert not missing, "public names missing from docs/api.md:\n  " + "\n  ".join(missing)


def test_every_command_is_documented():
    text = API.read_text()
    missing = [name for name in _commands() if f"`meshdsl {name}" not in text]
    assert not missing, f"docs/api.md does not document the commands {missing}"


def test_no_api_row_is_too_long():
    long = [f"{len(row)} chars: {row[:80]}..." for row in _rows(API.read_text()) if len(row) > MAX_ROW]
    assert not long, f"docs/api.md rows over {MAX_ROW} characters (move the detail to design.md):\n  " + "\n  ".join(
        long
    )


def test_the_row_parser_reads_shorthand():
    """The parser itself: bare names after a dotted one, methods, aliases and nested calls."""
    text = "\n".join(
        [
            "| name | what |",
            "|---|---|",
            "| `md.exp, log (x)` | a |",
            "| `md.Layout.load(path)`, `.spec(shape)` | b |",
            "| `planner.search(m, d=(1, 2)) -> SearchResult`, `layout.axes(s)` | c |",
            "| `meshdsl train [--x]` | d |",
            "| binary | `md.add, subtract (x, y)` | e |",
        ]
    )
    assert listed_names(text) == [
        "meshdsl.exp",
        "meshdsl.log",
        "meshdsl.Layout.load",
        "meshdsl.Layout.spec",
        "meshdsl.planner.search",
        "meshdsl.Layout.axes",
        "meshdsl.add",
        "meshdsl.subtract",
    ]


def test_every_shipped_layout_is_in_the_readme():
    text = (ROOT / "README.md").read_text()
    stems = sorted(p.stem for p in (ROOT / "layouts").glob("*.toml"))
    assert stems, "no layouts/*.toml found"
    missing = [s for s in stems if not re.search(rf"(?<![\w]){re.escape(s)}(?![\w])", text)]
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
