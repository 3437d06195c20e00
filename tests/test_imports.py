"""The package's import graph: no circle but the operator overloads', subpackages importing only as ``MAY_IMPORT`` says.

The graph is read from the source (``ast``), not from ``sys.modules``: an import inside a function
counts as much as one at the top of a file, since the circle it closes is only hidden until the
function runs. ``models/`` is read as ``meshdsl.models``, the name it is installed under. An edge
goes to the module an import names: ``from meshdsl import output_paths`` to ``meshdsl.runtime.output_paths``,
``from meshdsl.layout import Layout`` to ``meshdsl.layout``, ``import meshdsl as md`` to the package
``meshdsl`` (its ``__init__``). An import under ``if TYPE_CHECKING:`` is left out (it never runs), and
the loader's imports of the shipped models by name (``importlib``, which ``ast`` cannot see) are added.
"""

from __future__ import annotations

import ast
import functools
import itertools
from pathlib import Path

from meshdsl.models import NAMES

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"meshdsl": ROOT / "meshdsl", "meshdsl.models": ROOT / "models"}

ALLOWED_CYCLE = frozenset(
    {"meshdsl.tensor", "meshdsl.lowering.context", "meshdsl.ops.elementwise", "meshdsl.lowering.base"}
)
"""The one circle allowed, the operator overloads': ``Tensor``'s operators (``x + y``) call the elementwise
ops, which run under the current lowering (``lowering.context``), whose ``finish`` (``lowering.base``) makes
the resulting ``Tensor``. Haliax has the same circle (``NamedArray`` and its ops)."""

SIBLINGS = tuple(sorted(p.parent.name for p in (ROOT / "meshdsl").glob("*/__init__.py")))
"""The subpackages of ``meshdsl`` (bench, planner, train, lowering, ops, nn, measure, ...): any two may
import one another in one direction only."""

MAY_IMPORT: dict[str, frozenset[str]] = {
    # the core's helpers: they import only the top-level modules (dims, tensor, layout, ...)
    "lowering": frozenset(),
    "measure": frozenset(),
    "model": frozenset({"hf"}),  # the loader builds an ``hf:DIR`` model spec with md.hf
    "runtime": frozenset(),
    # what programs are written in: ops run under a lowering, layers are built of ops
    "ops": frozenset({"lowering"}),
    "nn": frozenset({"lowering", "ops"}),
    "analysis": frozenset({"model"}),
    "checkpoint": frozenset({"runtime"}),
    "pipeline": frozenset({"lowering", "model", "ops"}),
    # what runs programs: training, the planner, the benchmark
    "train": frozenset({"lowering", "measure", "model", "pipeline", "runtime"}),
    "planner": frozenset({"analysis", "lowering", "measure", "model", "nn", "runtime", "train"}),
    "bench": frozenset(
        {"analysis", "lowering", "measure", "model", "nn", "ops", "pipeline", "planner", "runtime", "train"}
    ),
    "labs": frozenset({"runtime", "train"}),
    # what a model is used for besides training: decoding with a KV cache, Hugging Face folders in and out
    "decoding": frozenset({"measure", "model", "ops", "runtime"}),
    "hf": frozenset({"checkpoint"}),
    # the command line: one file per command, on top of everything
    "commands": frozenset(
        {"bench", "checkpoint", "decoding", "hf", "labs", "measure", "model", "planner", "runtime", "train"}
    ),
}
"""Which subpackage may import which (the top-level modules, the core, any may import): the flow of
docs/design.md from the bottom (lowering, model, runtime) up to the commands. A new edge is a design
decision, made here, where the reviewer sees it; an edge that points back down the flow makes a circle."""

DYNAMIC = {"meshdsl.model.loader": {f"meshdsl.models.{name}" for name in NAMES}}
"""Imports made by name at run time: the loader imports a shipped model as ``meshdsl.models.<name>``."""


def _modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own, for its ``__init__``)."""
    out = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def _imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that the module ``name`` (file ``path``) imports, anywhere in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:`` (imported for the type checker only)."""
    out: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (at the top or in a function, or by name: ``DYNAMIC``)."""
    modules = _modules()
    return {name: _imported(name, path, modules) | DYNAMIC.get(name, set()) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _sibling(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in SIBLINGS else None


def sibling_edges(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """(importing subpackage, imported subpackage) -> the imports that make the edge (``a -> b``)."""
    out: dict[tuple[str, str], list[str]] = {}
    for a, targets in graph.items():
        for b in targets:
            pa, pb = _sibling(a), _sibling(b)
            if pa and pb and pa != pb:
                out.setdefault((pa, pb), []).append(f"{a} -> {b}")
    return out


def test_reader_sees_function_level_and_relative_imports(tmp_path):
    """The reader finds an import in a function body, resolves ``from .x import y`` and ``from p import module``,
    and leaves out an import made for the type checker only."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("def f():\n    from pkg import b\n")
    (tmp_path / "pkg" / "b.py").write_text("from .c import thing\n")
    (tmp_path / "pkg" / "c.py").write_text(
        "import pkg.a\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg\n"
    )
    modules = {"pkg": tmp_path / "pkg" / "__init__.py"}
    modules.update({f"pkg.{n}": tmp_path / "pkg" / f"{n}.py" for n in "abc"})
    graph = {name: _imported(name, path, modules) for name, path in modules.items()}
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": {"pkg.a"}}
    assert cycles(graph) == [frozenset({"pkg.a", "pkg.b", "pkg.c"})]


def test_graph_covers_the_package():
    graph = import_graph()
    assert {"meshdsl.tensor", "meshdsl.models.mlp", "meshdsl.train.loop", "meshdsl.bench.run"} <= set(graph)
    assert "meshdsl.lowering.context" in graph["meshdsl.tensor"]


def test_no_import_cycle_but_the_operator_overloads():
    found = cycles(import_graph())
    assert found == [ALLOWED_CYCLE], "import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in found)


def test_no_two_sibling_subpackages_import_each_other():
    edges = sibling_edges(import_graph())
    both = [
        f"{a} <-> {b}: {edges[a, b][0]} and {edges[b, a][0]}"
        for a, b in itertools.combinations(SIBLINGS, 2)
        if (a, b) in edges and (b, a) in edges
    ]
    assert not both, "sibling subpackages importing each other: " + "; ".join(both)


def test_every_subpackage_is_in_the_table():
    assert set(MAY_IMPORT) == set(SIBLINGS), f"MAY_IMPORT lists {sorted(MAY_IMPORT)}, the package has {SIBLINGS}"


def test_subpackages_import_only_what_the_table_allows():
    edges = sibling_edges(import_graph())
    wrong = [f"{a} -> {b}: {edges[a, b][0]}" for a, b in sorted(edges) if b not in MAY_IMPORT[a]]
    assert not wrong, "imports the table MAY_IMPORT does not allow:\n  " + "\n  ".join(wrong)


def test_the_table_allows_no_circle():
    """Read as a graph, the table itself has no circle, so no two subpackages import each other."""
    graph = {a: set(b) for a, b in MAY_IMPORT.items()}
    assert cycles(graph) == [] and all(a not in b for a, b in graph.items())
