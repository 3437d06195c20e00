"""The global-array lowering, noting the shape of every tensor an op takes or makes.

Tracing a function under it (``jax.eval_shape``: nothing compiled or computed) lists the shapes of
its parameters, inputs and activations: which dims a model has, and which dims meet in one tensor
(:mod:`meshdsl.train.rules` checks layouts against them, :mod:`meshdsl.planner.roles` infers
what each dim can be split for).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from meshdsl.dims import Shape
from meshdsl.lowering.base import GlobalLowering
from meshdsl.lowering.context import use


class ShapeRecorder(GlobalLowering):
    """Global arrays, nothing split; ``shapes`` holds every tensor shape ops touched, in order."""

    def __init__(self) -> None:
        self.shapes: list[Shape] = []

    def axes(self, shape: Shape, tensor: str = "tensor") -> Any:
        self.shapes.append(shape)
        return super().axes(shape, tensor)

    def prepare(self, t: Any, axes: Any = None, beside: Any = ()) -> jax.Array:
        self.shapes.append(t.shape)
        return super().prepare(t, axes, beside)

    def finish(self, array: jax.Array, shape: Shape, *args: Any, **kwargs: Any) -> Any:
        self.shapes.append(shape)
        return super().finish(array, shape, *args, **kwargs)

    def keep(self, array: jax.Array, shape: Shape, axes: Any) -> Any:
        self.shapes.append(shape)
        return super().keep(array, shape, axes)


def recorded_shapes(fn: Callable[..., Any], *args: Any) -> list[Shape]:
    """The shape of every tensor the ops of ``fn(*args)`` take or make, traced on global arrays
    (``args``: abstract values, e.g. ``jax.ShapeDtypeStruct`` or md tensors of them)."""
    recorder = ShapeRecorder()
    with use(recorder):
        jax.eval_shape(fn, *args)
    return recorder.shapes
