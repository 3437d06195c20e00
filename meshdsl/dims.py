"""Named dimensions and ordered shapes.

A :class:`Dim` is a name and a size; a :class:`Shape` is an ordered tuple of dims with distinct
names. Names, not positions, are what ops and layouts refer to: ``x + y`` lines up dims by name
and a layout rule ``d_ff:model`` splits every tensor that has a ``d_ff`` dim.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import overload

from meshdsl.errors import ShapeError

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclasses.dataclass(frozen=True)
class Dim:
    """A named dimension: ``Dim("batch", 32)``."""

    name: str
    size: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ShapeError(f"dim name {self.name!r} is not an identifier (letters, digits, '_')")
        try:
            size = operator.index(self.size)
        except TypeError:
            size = -1
        if isinstance(self.size, bool) or size < 0:
            raise ShapeError(f"dim {self.name!r} has size {self.size!r}; a size is a non-negative int")
        if size >= 2**63:  # XLA's sizes are int64: a larger one overflows where the array is made
            raise ShapeError(f"dim {self.name!r} has size {size}; a size is below 2**63 (XLA's sizes are 64-bit)")
        object.__setattr__(self, "size", size)

    def __str__(self) -> str:
        return f"{self.name}={self.size}"

    def __repr__(self) -> str:
        return f"Dim({self.name!r}, {self.size})"


DimLike = Dim | str


class Shape:
    """An ordered list of dims with distinct names.

    ``shape.names`` and ``shape.sizes`` are tuples; ``shape["batch"]`` or ``shape[0]`` gives a
    :class:`Dim`; ``"batch" in shape`` tests a name; ``shape.size`` is the number of elements.
    """

    __slots__ = ("dims",)

    def __init__(self, dims: Iterable[Dim] | Shape = ()):
        dims = tuple(dims.dims if isinstance(dims, Shape) else dims)
        for d in dims:
            if not isinstance(d, Dim):
                raise ShapeError(f"a Shape is built from md.Dim objects, got {d!r}")
        names = [d.name for d in dims]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ShapeError(f"shape [{', '.join(map(str, dims))}] repeats dim name(s) {', '.join(repeated)}")
        self.dims: tuple[Dim, ...] = dims

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.dims)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(d.size for d in self.dims)

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def size(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.dims:
            n *= d.size
        return n

    def index(self, name: DimLike) -> int:
        """Position of the dim called ``name`` (a name, or a Dim of the same size); ShapeError if absent."""
        if not isinstance(name, (Dim, str)):
            raise ShapeError(f"a dim is named by a string or an md.Dim, got {type(name).__name__} {name!r}")
        key = name.name if isinstance(name, Dim) else name
        for i, d in enumerate(self.dims):
            if d.name == key:
                if isinstance(name, Dim) and name.size != d.size:
                    raise ShapeError(f"dim {name} does not match {d} of shape {self}")
                return i
        raise ShapeError(f"shape {self} has no dim {key!r}")

    def __getitem__(self, key: int | DimLike) -> Dim:
        if isinstance(key, int):
            return self.dims[key]
        return self.dims[self.index(key)]

    def __contains__(self, name: object) -> bool:
        key = name.name if isinstance(name, Dim) else name
        return key in self.names

    def __iter__(self) -> Iterator[Dim]:
        return iter(self.dims)

    def __len__(self) -> int:
        return len(self.dims)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Shape) and self.dims == other.dims

    def __hash__(self) -> int:
        return hash(self.dims)

    def __add__(self, other: Shape | Sequence[Dim]) -> Shape:
        return Shape(self.dims + tuple(as_shape(other).dims))

    def without(self, names: Iterable[DimLike]) -> Shape:
        """This shape minus the named dims."""
        drop = {n.name if isinstance(n, Dim) else n for n in names}
        return Shape(d for d in self.dims if d.name not in drop)

    def __str__(self) -> str:
        return "[" + ", ".join(map(str, self.dims)) + "]"

    def __repr__(self) -> str:
        return f"Shape({self})"


ShapeLike = Shape | Sequence[Dim] | Dim


def as_shape(shape: ShapeLike) -> Shape:
    """A :class:`Shape` from a Shape, a Dim or a sequence of Dims."""
    if isinstance(shape, Shape):
        return shape
    if isinstance(shape, Dim):
        return Shape([shape])
    if isinstance(shape, str):
        raise ShapeError(f"a shape of names {shape!r} needs sizes: pass md.Dim objects here")
    if not isinstance(shape, (list, tuple)):
        raise ShapeError(f"a shape is a list of md.Dim objects, got {type(shape).__name__} {shape!r}")
    return Shape(shape)


@overload
def dim_names(dims: DimLike | Iterable[DimLike]) -> tuple[str, ...]: ...
@overload
def dim_names(dims: None) -> None: ...
def dim_names(dims: DimLike | Iterable[DimLike] | None) -> tuple[str, ...] | None:
    """Names from a name, a Dim, a space-separated string, a Shape or a list of those; None stays None."""
    if dims is None:
        return None
    if isinstance(dims, Dim):
        return (dims.name,)
    if isinstance(dims, str):
        return tuple(dims.split())
    if isinstance(dims, Shape):
        return dims.names
    if not isinstance(dims, (list, tuple)):
        raise ShapeError(
            f"dims are a name, an md.Dim, a string of names or a list of those, got {type(dims).__name__} {dims!r}"
        )
    out: list[str] = []
    for d in dims:
        out.extend(dim_names(d))
    return tuple(out)


def resolve(names: DimLike | Iterable[DimLike], shape: Shape) -> tuple[Dim, ...]:
    """Dims of ``shape`` named by ``names`` (Dims must also match the size)."""
    if isinstance(names, (Dim, str)):
        items = [names]
    elif isinstance(names, (Shape, list, tuple)):
        items = list(names)
    else:
        raise ShapeError(
            f"dims are a name, an md.Dim, a string of names or a list of those, got {type(names).__name__} {names!r}"
        )
    out: list[Dim] = []
    for item in items:
        for name in dim_names(item):
            d = shape[name]
            if isinstance(item, Dim) and item.size != d.size:
                raise ShapeError(f"dim {item} does not match {d} of shape {shape}")
            out.append(d)
    return tuple(out)
