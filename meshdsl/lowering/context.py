"""The active lowering: ops ask :func:`current` how to run."""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

import jax

from meshdsl.errors import MeshDslError, ModelError, ShapeError
from meshdsl.lowering.base import GlobalLowering, Lowering
from meshdsl.tensor import Tensor, describe

if TYPE_CHECKING:
    from meshdsl.layout import Layout

_state = threading.local()
_EAGER = GlobalLowering()
F = TypeVar("F", bound=Callable)


def current() -> Lowering:
    """The lowering ops run under now: the innermost :func:`use`, else eager global arrays."""
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else _EAGER


@contextlib.contextmanager
def use(lowering: Lowering) -> Iterator[Lowering]:
    """Run the ops inside the block under ``lowering``."""
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    stack.append(lowering)
    try:
        yield lowering
    finally:
        stack.pop()


@contextlib.contextmanager
def use_layout(layout: Layout | str | dict) -> Iterator[Lowering]:
    """Inside ``md.compile``, run the ops in the block under other layout rules.

    Tensors keep their own layout and are moved only when an op needs them elsewhere. Training
    uses this to update parameters in their stored (e.g. FSDP) layout without gathering them.
    Outside ``md.compile`` it changes nothing.
    """
    from meshdsl.layout import Layout

    with use(current().with_layout(layout if isinstance(layout, Layout) else Layout(layout))) as lowering:
        yield lowering


@contextlib.contextmanager
def op_scope(name: str) -> Iterator[None]:
    """The block as the meshdsl op ``name``: its collectives show under that name in ``md.explain``
    (the ``md.<name>`` name scope) and every md error raised in it starts with ``name:``.

    What :func:`op` does around a function; used directly only where the op's name is data (the
    element-wise family, written once for all its names)."""
    try:
        with jax.named_scope(f"md.{name}"):
            yield
    except MeshDslError as e:
        # Already named: by this op, by another one (its ``op``), or by the user's file and line (ModelError).
        if isinstance(e, ModelError) or e.op is not None:
            raise
        raise type(e)(f"{name}: {e}", op=name) from None


@contextlib.contextmanager
def naming(name: str) -> Iterator[None]:
    """The md errors raised in the block name the op ``name`` already (their message starts with it,
    as ``conv2d result [...]: ...`` does): their ``op`` is ``name``, so :func:`op_scope` adds nothing."""
    try:
        yield
    except MeshDslError as e:
        if e.op is None:
            e.op = name
        raise


def op(name: str) -> Callable[[F], F]:
    """Mark a function as the meshdsl op ``name``: it runs in :func:`op_scope` (its collectives show
    under that name in ``md.explain``; every md error it raises starts with ``name:``), and its
    arguments annotated ``Tensor`` must be md tensors. The one way an op is declared."""

    def wrap(fn: F) -> F:
        signature = inspect.signature(fn)
        tensors = [
            p
            for p, param in signature.parameters.items()
            if param.annotation in ("Tensor", Tensor) and param.kind is not param.VAR_POSITIONAL
        ]

        @functools.wraps(fn)
        def run(*args, **kwargs):
            if tensors:
                bound = signature.bind_partial(*args, **kwargs).arguments
                for p in tensors:
                    if p in bound and not isinstance(bound[p], Tensor):
                        raise ShapeError(
                            f"{name}: {p} must be an md tensor, got {describe(bound[p])}; wrap an array with "
                            "md.tensor(array, dims)",
                            op=name,
                        )
            with op_scope(name):
                return fn(*args, **kwargs)

        return run  # type: ignore[return-value]

    return wrap
