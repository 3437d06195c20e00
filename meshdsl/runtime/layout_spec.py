"""What a ``--layout`` argument names: a layout TOML file, a shipped layout, or inline rules.

Every command takes a layout the same way (``train``, ``bench``, ``explain``, ``search``, ``launch``):
a path to a TOML file (anywhere), the name of a shipped layout (``dp_tp`` is the installed
``meshdsl/layouts/dp_tp.toml``, found wherever meshdsl is installed), or rules written inline
(``"batch:data; d_ff:model"``, on the mesh ``data=-1``). The spec becomes a :class:`~meshdsl.layout.Layout`
here, beside it, so no command imports another's module to read one.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

from meshdsl.errors import LayoutError
from meshdsl.layout import Layout

LAYOUTS = Path(str(importlib.resources.files("meshdsl.layouts"))).resolve()
"""The shipped layout files: the package data of ``meshdsl.layouts`` (the repository's
``layouts/`` folder), found wherever meshdsl is installed."""


def shipped_layouts() -> list[str]:
    """The shipped layouts' names (``data_parallel``, ``dp_tp``, ...), sorted."""
    return sorted(p.stem for p in LAYOUTS.glob("*.toml"))


def is_shipped(path: str | Path | None) -> bool:
    """Whether ``path`` is one of the shipped layout files."""
    return path is not None and Path(path).resolve().parent == LAYOUTS


def layout_path(spec: str) -> Path | None:
    """The TOML file a layout spec names (a path, or a shipped layout's name), or None for inline rules.

    LayoutError for an empty spec, and for one that is neither a file, a shipped layout nor rules."""
    shipped = ", ".join(shipped_layouts())
    if not spec.strip():
        raise LayoutError(
            f"layout {spec!r} is empty: give a layout TOML file, a shipped layout ({shipped}) "
            "or rules like 'batch:data'"
        )
    if Path(spec).exists() or spec.endswith(".toml"):
        return Path(spec)
    if (LAYOUTS / f"{spec}.toml").exists():
        return LAYOUTS / f"{spec}.toml"
    if ":" not in spec:
        raise LayoutError(
            f"layout {spec!r} is neither a file, a shipped layout ({shipped}) nor rules like 'batch:data'"
        )
    return None


def load_layout(spec: str) -> Layout:
    """A layout from a TOML path, a shipped layout's name (``dp_tp``: ``layouts/dp_tp.toml``), or inline rules."""
    path = layout_path(spec)
    return Layout(spec, mesh_axes={"data": -1}) if path is None else Layout.load(path)
