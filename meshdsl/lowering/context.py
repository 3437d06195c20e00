"""The active lowering: ops ask :func:`current` how to run."""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import TYPE_CHECKING, Callable, Iterator, TypeVar

import jax

from meshdsl.lowering.base import Lowering

if TYPE_CHECKING:
    from meshdsl.layout import Layout

_state = threading.local()
_EAGER = Lowering()
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
def use_layout(layout: "Layout | str | dict") -> Iterator[Lowering]:
    """Inside ``md.compile``, run the ops in the block under other layout rules.

    Tensors keep their own layout and are moved only when an op needs them elsewhere. Training
    uses this to update parameters in their stored (e.g. FSDP) layout without gathering them.
    Outside ``md.compile`` it changes nothing.
    """
    from meshdsl.layout import Layout

    with use(current().with_layout(layout if isinstance(layout, Layout) else Layout(layout))) as lowering:
        yield lowering


def op(name: str) -> Callable[[F], F]:
    """Mark a function as the meshdsl op ``name``: its collectives show under that name in ``md.explain``."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args, **kwargs):
            with jax.named_scope(f"md.{name}"):
                return fn(*args, **kwargs)

        return run  # type: ignore[return-value]

    return wrap
