"""The line of code that traced a jaxpr equation, so ``explain`` can say where each collective comes from.

JAX keeps, in each equation's ``source_info.traceback``, the Python stack that traced it
(innermost frame first; a gradient's equations keep the stack of the forward equation they
transpose). JAX's own filter (``source_info_util.user_frame``) skips only JAX and the standard
library, so for an md op it stops inside meshdsl. Here the line named is the innermost frame
of the user's code: outside JAX, jaxlib, meshdsl, installed packages, the standard library and
the interpreter's scripts; the models meshdsl ships (``meshdsl.models``) count as the user's,
as the user's own model file does. A collective no user code asked for (the train step's loss
reduction, its gradient norm) names the innermost line of meshdsl outside the machinery every
op goes through (lowering, relayouts, ops), e.g. ``meshdsl/train/optim.py:55``.
"""

from __future__ import annotations

import functools
import sysconfig
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jax
import jaxlib

from meshdsl.model.user import _shown

MACHINERY = ("lowering", "ops", "relayout.py", "tensor.py")
"""Parts of meshdsl every op goes through: a line there says nothing about where a collective comes from."""


def _folders(paths: Iterable[str]) -> tuple[Path, ...]:
    return tuple(Path(p).resolve() for p in paths)


def _under(path: Path, folders: tuple[Path, ...]) -> Path | None:
    return next((f for f in folders if f in path.parents), None)


@functools.cache
def _meshdsl() -> tuple[Path, ...]:
    """meshdsl's own folder (the package's: this module lives in ``meshdsl/analysis/``)."""
    return (Path(__file__).resolve().parents[1],)


@functools.cache
def _shipped() -> tuple[Path, ...]:
    import meshdsl.models

    return _folders(meshdsl.models.__path__)


@functools.cache
def _theirs() -> tuple[Path, ...]:
    """Folders whose code is neither the user's nor meshdsl's."""
    names = ("stdlib", "platstdlib", "purelib", "platlib", "scripts")
    installed = [sysconfig.get_path(name) for name in names]
    return _folders([*jax.__path__, *jaxlib.__path__, *filter(None, installed)])


@functools.cache
def _rank(filename: str) -> tuple[int, str]:
    """How well a frame in ``filename`` says where a collective comes from (0 best, 3: not at all),
    and the file as shown (a shipped model or meshdsl's own file from ``meshdsl/``)."""
    if filename.startswith("<"):
        return 3, filename
    path = Path(filename).resolve()
    shipped = _under(path, _shipped())
    if shipped is not None:
        return 0, str(Path("meshdsl", "models", path.relative_to(shipped)))
    ours = _under(path, _meshdsl())
    if ours is not None:
        inside = path.relative_to(ours)
        return (2 if inside.parts[0] in MACHINERY else 1), str(Path("meshdsl", inside))
    if _under(path, _theirs()) is not None:
        return 3, filename
    return 0, _shown(filename)


def user_line(source_info: Any) -> str:
    """``FILE:LINE`` of the innermost frame of the user's code in ``source_info`` (a jaxpr equation's),
    the file relative to the working folder when inside it; else of meshdsl's (see the module); else ""."""
    return ranked_line(source_info)[1]


def ranked_line(source_info: Any) -> tuple[int, str]:
    """:func:`user_line` with its rank: 0 for the user's code (or a shipped model), 1 for meshdsl's
    outside the ops' machinery, 2 inside it, 3 for no line."""
    traceback = getattr(source_info, "traceback", None)
    best: tuple[int, str] = (3, "")
    for frame in getattr(traceback, "frames", ()):
        rank, shown = _rank(frame.file_name)
        if rank < best[0]:
            best = (rank, f"{shown}:{frame.line_num}")
            if rank == 0:
                break
    return best
