"""The user's own model, its mistakes reported in the user's terms.

:class:`UserModel` wraps a ``Model`` loaded from the user's file or module (see
:mod:`meshdsl.model_loader`): ``init``, ``batch`` and ``loss`` run the user's methods, and an
exception there, or a result meshdsl cannot use, becomes one line naming the user's file and line
and what was expected, so ``train``, ``bench``, ``explain``, ``search`` and ``launch`` all say the
same thing. Everything else (the config, the optional and pipeline parts) is the user's object's.
"""

from __future__ import annotations

import inspect
import linecache
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from meshdsl.errors import MeshDslError, ModelError
from meshdsl.tensor import Tensor, describe, is_tensor

LOSS = "a scalar float md tensor (the mean loss, e.g. md.reduce_mean(...) over every dim)"
TREE = "a pytree (dict, list, tuple) of md tensors"
CALLS = {"init": ("key",), "batch": ("key",), "loss": ("params", "batch")}
"""How meshdsl calls each method of a model."""


def location(error: BaseException, mine: Sequence[Path], anywhere: bool = False) -> str | None:
    """``FILE:LINE (`code`)`` of the deepest frame of ``error``'s traceback in ``mine`` (the user's files
    or folders); with ``anywhere``, else of the deepest frame at all; else None."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if _is_mine(f.filename, mine)]
    if not ours and anywhere:
        ours = [f for f in frames if not f.filename.startswith("<frozen")] or frames
    return _at(ours[-1].filename, ours[-1].lineno) if ours else None


def error_text(error: BaseException) -> str:
    """``Type: message`` of ``error``, its message's first line only (JAX's run to paragraphs)."""
    text = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def call(fn: Callable[..., Any], args: tuple, what: str, mine: Sequence[Path]) -> Any:
    """``fn(*args)``, the user's code; an exception from it as one line ``FILE:LINE (`code`): WHAT failed:
    Type: message`` at its deepest frame in ``mine`` (else where ``fn`` is defined). An md error keeps
    its class (a LayoutError stays one: it may be the layout's); any other becomes a ModelError."""
    try:
        return fn(*args)
    except Exception as e:
        where = location(e, mine) or defined_at(fn) or "?"
        if isinstance(e, MeshDslError):
            raise type(e)(f"{where}: {what} failed: {e}") from e
        raise ModelError(f"{where}: {what} failed: {error_text(e)}") from e


def defined_at(fn: Any) -> str | None:
    """``FILE:LINE (`code`)`` where the function, method or class ``fn`` is defined, if it is Python code."""
    fn = getattr(fn, "__init__", fn) if isinstance(fn, type) else fn
    code = getattr(inspect.unwrap(getattr(fn, "__func__", fn)), "__code__", None)
    return None if code is None else _at(code.co_filename, code.co_firstlineno)


def _at(filename: str, line: int) -> str:
    code = linecache.getline(filename, line).strip()
    return f"{_shown(filename)}:{line}" + (f" (`{code}`)" if code else "")


def _shown(filename: str) -> str:
    """``filename`` relative to the working folder when it is inside it (as the user typed it), else whole."""
    path = Path(filename)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return filename


def _is_mine(filename: str, mine: Sequence[Path]) -> bool:
    if filename.startswith("<"):
        return False
    path = Path(filename).resolve()
    return any(path == m or m in path.parents for m in mine)


class UserModel:
    """The user's ``model`` (from ``spec``, whose code lies in ``mine``) with its entry points checked.

    Built by :func:`meshdsl.model_loader.build_model`, which first checks that ``init``, ``batch`` and
    ``loss`` take the arguments meshdsl passes. Attributes other than these three are the model's own.
    """

    __slots__ = ("model", "spec", "mine")

    def __init__(self, model: Any, spec: str, mine: Sequence[Path]):
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "spec", spec)
        object.__setattr__(self, "mine", tuple(mine))
        for name, args in CALLS.items():
            _check_signature(model, name, args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.model, name, value)

    def __repr__(self) -> str:
        return f"UserModel({self.spec}: {self.model!r})"

    def init(self, key: jax.Array) -> Any:
        return self._checked("init", (key,), _is_tree)

    def batch(self, key: jax.Array) -> Any:
        return self._checked("batch", (key,), _is_tree)

    def loss(self, params: Any, batch: Any) -> Tensor:
        return self._checked("loss", (params, batch), _is_loss)

    def _checked(self, name: str, args: tuple, problem: Callable[[Any], str | None]) -> Any:
        method = getattr(self.model, name)
        what = f"{type(self.model).__name__}.{name}({', '.join(CALLS[name])})"
        out = call(method, args, what, self.mine)
        wrong = problem(out)
        if wrong:
            raise ModelError(f"{defined_at(method) or self.spec}: {what} returned {wrong}")
        return out


def _check_signature(model: Any, name: str, args: tuple[str, ...]) -> None:
    """ModelError at the method's line unless ``model.name`` can be called with ``args``."""
    method = getattr(model, name)
    try:
        signature = inspect.signature(method)
    except (TypeError, ValueError):  # not introspectable (a builtin): calling it will tell
        return
    try:
        signature.bind(*args)
    except TypeError:
        shown = inspect.signature(getattr(method, "__func__", method))
        raise ModelError(
            f"{defined_at(method) or type(model).__name__}: {type(model).__name__}.{name} takes {shown}, "
            f"but meshdsl calls {name}({', '.join(args)})"
        ) from None


def _is_loss(out: Any) -> str | None:
    """What is wrong with ``out`` as a loss, or None."""
    if isinstance(out, Tensor) and not out.shape.rank and jnp.issubdtype(out.dtype, jnp.floating):
        return None
    return f"{describe(out)}; meshdsl needs {LOSS}"


def _is_tree(out: Any) -> str | None:
    """What is wrong with ``out`` as params or a batch (a leaf that is no md tensor), or None."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(out, is_leaf=is_tensor)
    for path, leaf in leaves:
        if not isinstance(leaf, Tensor):
            return f"{describe(leaf)} at {jax.tree_util.keystr(path) or 'the top'}; meshdsl needs {TREE}"
    return None
