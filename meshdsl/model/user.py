"""The user's own model, its mistakes reported in the user's terms.

:class:`UserModel` wraps a ``Model`` loaded from the user's file or module (see
:mod:`meshdsl.model.loader`): ``init``, ``batch`` and ``loss`` run the user's methods, and an
exception there, or a result meshdsl cannot use, becomes one line naming the user's file and line
and what was expected, so ``train``, ``bench``, ``explain``, ``search`` and ``launch`` all say the
same thing. So do the pipeline parts (``pre``, ``layer``, ``post``) where the model has them, and
``with_batch(rows)`` returns the smaller model checked the same way. Everything else (the config,
the other optional parts) is the user's object's.
"""

from __future__ import annotations

import functools
import inspect
import linecache
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from meshdsl.errors import MeshDslError, ModelError
from meshdsl.model.protocol import Model
from meshdsl.tensor import Tensor, describe, is_tensor

LOSS = "a scalar float md tensor (the mean loss, e.g. md.reduce_mean(...) over every dim)"
TREE = "a pytree (dict, list, tuple) of md tensors"
CALLS = {"init": ("key",), "batch": ("key",), "loss": ("params", "batch")}
"""How meshdsl calls each method of a model."""
PARTS = {"pre": ("params", "batch"), "layer": ("x", "p"), "post": ("params", "x", "batch"), "with_batch": ("size",)}
"""How :mod:`meshdsl.pipeline` (and gradient accumulation) calls a model's optional pipeline parts."""


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


def _at(filename: str, line: int | None) -> str:
    if line is None:  # a frame without a line number (the traceback module allows it)
        return _shown(filename)
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

    Built by :func:`meshdsl.model.loader.build_model`, which first checks that ``init``, ``batch`` and
    ``loss`` take the arguments meshdsl passes. The pipeline parts in :data:`PARTS`, where the model
    has them, are checked as they are called. Other attributes are the model's own.
    """

    __slots__ = ("model", "spec", "mine")

    def __init__(self, model: Model, spec: str, mine: Sequence[Path]):
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "spec", spec)
        object.__setattr__(self, "mine", tuple(mine))
        for name, args in CALLS.items():
            _check_signature(model, name, args)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.model, name)
        if name not in PARTS or not callable(value):
            return value
        check = _model_problem if name == "with_batch" else _loss_problem if name == "post" else _activations_problem

        def part(*args: Any) -> Any:
            return self._checked(name, args, check, PARTS[name])

        return functools.update_wrapper(part, value)

    @property
    def config(self) -> Any:
        """The model's config, declared here (not only reached through ``__getattr__``) so that
        ``isinstance(user_model, meshdsl.model.protocol.Model)`` holds on Python 3.12, whose protocol
        check looks attributes up statically."""
        return self.model.config

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.model, name, value)

    def __repr__(self) -> str:
        return f"UserModel({self.spec}: {self.model!r})"

    def init(self, key: jax.Array) -> Any:
        return self._checked("init", (key,), _params_problem)

    def batch(self, key: jax.Array) -> Any:
        return self._checked("batch", (key,), _is_tree)

    def loss(self, params: Any, batch: Any) -> Tensor:
        return self._checked("loss", (params, batch), _loss_problem)

    def _checked(
        self, name: str, args: tuple, problem: Callable[[Any], str | None], arguments: tuple[str, ...] = ()
    ) -> Any:
        method = getattr(self.model, name)
        what = f"{type(self.model).__name__}.{name}({', '.join(arguments or CALLS[name])})"
        out = call(method, args, what, self.mine)
        wrong = problem(out)
        if wrong:
            raise ModelError(f"{defined_at(method) or self.spec}: {what} returned {wrong}")
        if name == "with_batch" and not isinstance(out, UserModel):
            return UserModel(out, self.spec, self.mine)
        return out


def describe_model(model: object) -> str:
    """``model`` for a message: a user's model by the file or module it came from (``llama.py``), never by
    the name meshdsl imported it under; another (a shipped one) by its class (``meshdsl.models.mlp.Model``)."""
    if isinstance(model, UserModel):
        return f"{model.spec} ({type(model.model).__name__})"
    return f"{type(model).__module__}.{type(model).__qualname__}"


def _check_signature(model: Model, name: str, args: tuple[str, ...]) -> None:
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


def _loss_problem(out: Any) -> str | None:
    """What is wrong with ``out`` as a loss, or None."""
    if isinstance(out, Tensor) and not out.shape.rank and jnp.issubdtype(out.dtype, jnp.floating):
        return None
    return f"{describe(out)}; meshdsl needs {LOSS}"


def _activations_problem(out: Any) -> str | None:
    """What is wrong with ``out`` as the activations a pipeline part passes on, or None."""
    return None if isinstance(out, Tensor) else f"{describe(out)}; meshdsl needs an md tensor (the activations)"


def _model_problem(out: Any) -> str | None:
    """What is wrong with ``out`` as the model ``with_batch`` returns, or None."""
    if all(callable(getattr(out, name, None)) for name in CALLS):
        return None
    return f"{describe(out)}; meshdsl needs a model (with {', '.join(CALLS)}) for the smaller batch"


def _params_problem(out: Any) -> str | None:
    """What is wrong with ``out`` as parameters (a leaf that is no md tensor, or not a float one:
    gradients are taken of every parameter), or None."""
    wrong = _is_tree(out)
    if wrong:
        return wrong
    for path, leaf in jax.tree_util.tree_flatten_with_path(out, is_leaf=is_tensor)[0]:
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            return (
                f"an md tensor of {jnp.dtype(leaf.dtype).name} at {jax.tree_util.keystr(path) or 'the top'}; "
                "meshdsl trains every parameter, so each must be a float md tensor (an integer constant "
                "belongs on the Model, not in init's params)"
            )
    return None


def _is_tree(out: Any) -> str | None:
    """What is wrong with ``out`` as params or a batch (a leaf that is no md tensor), or None."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(out, is_leaf=is_tensor)
    for path, leaf in leaves:
        if not isinstance(leaf, Tensor):
            return f"{describe(leaf)} at {jax.tree_util.keystr(path) or 'the top'}; meshdsl needs {TREE}"
    return None
