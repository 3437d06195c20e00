"""Ops that rename, reorder or regroup dims: ``reshape``, ``rename``, ``replace_dimensions``,
``transpose`` and ``rearrange``.

A reshape reads the data in row-major order, so it matches groups of consecutive dims whose sizes
multiply to the same number (``[a=4, b=6] -> [c=24]`` is one group). Inside a group:

* one dim to one dim (a rename): the split moves with the data by position, so only the layout
  rule of the new name matters. ``relayout`` gets there: nothing if the rules agree, an
  ``all_gather`` if the new name is replicated, a local slice if only the new name is split, an
  ``all_to_all`` if the split moves to another dim;
* several dims: the local reshape stays valid if the leading dims on both sides are split over
  the same axes (each device holds one contiguous block of the group); any other split in the
  group is gathered first and the result's own splits are sliced after.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import jax.numpy as jnp
from einops import EinopsError
from einops.parsing import ParsedExpression

from meshdsl.dims import Dim, DimLike, Shape, ShapeLike, as_shape, dim_names
from meshdsl.errors import ShapeError
from meshdsl.lowering.context import current, op
from meshdsl.tensor import Tensor


def _groups(a: Sequence[int], b: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Consecutive runs of dims of ``a`` and ``b`` with equal products."""
    groups, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        ga, gb, pa, pb = [], [], 1, 1
        if i < len(a):
            ga.append(i)
            pa, i = a[i], i + 1
        if j < len(b):
            gb.append(j)
            pb, j = b[j], j + 1
        while pa != pb:
            if pa < pb and i < len(a):
                ga.append(i)
                pa, i = pa * a[i], i + 1
            elif pb < pa and j < len(b):
                gb.append(j)
                pb, j = pb * b[j], j + 1
            else:
                raise ShapeError(f"cannot reshape sizes {tuple(a)} into {tuple(b)}")
        groups.append((ga, gb))
    return groups


@op("reshape")
def reshape(x: Tensor, new_shape: ShapeLike) -> Tensor:
    """``x``'s data, row-major, read as ``new_shape`` (same number of elements)."""
    new_shape = as_shape(new_shape)
    if new_shape.size != x.shape.size:
        raise ShapeError(
            f"reshape: {x.shape} has {x.shape.size} elements, {new_shape} has {new_shape.size}", op="reshape"
        )
    lowering = current()
    own, target = lowering.axes(x.shape), lowering.axes(new_shape)
    compute: list[tuple[str, ...]] = list(own)
    local: list[tuple[str, ...]] = [()] * new_shape.rank
    for ga, gb in _groups(x.shape.sizes, new_shape.sizes):
        if len(ga) == 1 and len(gb) == 1:
            local[gb[0]] = own[ga[0]]
            continue
        keep = own[ga[0]] if ga and gb and own[ga[0]] == target[gb[0]] else ()
        for k in ga:
            compute[k] = ()
        if ga:
            compute[ga[0]] = keep
        if gb:
            local[gb[0]] = keep
    array = lowering.prepare(x, tuple(compute))
    sizes = [d.size // lowering.group_size(a) for d, a in zip(new_shape, local)]
    return lowering.finish(jnp.reshape(array, sizes), new_shape, tuple(local))


@op("rename")
def rename(x: Tensor, old: DimLike, new: DimLike) -> Tensor:
    """``x`` with dim ``old`` renamed to ``new`` (a name, or a Dim of the same size)."""
    d = x.shape[old]
    new_dim = new if isinstance(new, Dim) else Dim(new, d.size)
    if new_dim.size != d.size:
        raise ShapeError(f"rename: {new_dim} does not have the size of {d}", op="rename")
    return reshape(x, Shape(new_dim if e.name == d.name else e for e in x.shape))


@op("replace_dimensions")
def replace_dimensions(x: Tensor, old: DimLike | Sequence[DimLike], new: Dim | Sequence[Dim]) -> Tensor:
    """``x`` with the consecutive dims ``old`` replaced by the dims ``new`` (same number of elements)."""
    names = dim_names(old)
    positions = [x.shape.index(n) for n in names]
    if positions != list(range(positions[0], positions[0] + len(positions))):
        raise ShapeError(
            f"replace_dimensions: dims {list(names)} are not consecutive in {x.shape}", op="replace_dimensions"
        )
    new_dims = [new] if isinstance(new, Dim) else list(new)
    dims = list(x.shape)
    dims[positions[0] : positions[-1] + 1] = new_dims
    return reshape(x, Shape(dims))


@op("transpose")
def transpose(x: Tensor, dims: Sequence[DimLike] | str) -> Tensor:
    """``x`` with its dims reordered as ``dims`` (all of them, by name). No communication."""
    names = dim_names(dims)
    if sorted(names) != sorted(x.shape.names):
        raise ShapeError(f"transpose: {list(names)} is not a reordering of the dims of {x.shape}", op="transpose")
    lowering = current()
    perm = [x.shape.index(n) for n in names]
    axes = lowering.axes(x.shape)
    out = Shape(x.shape[i] for i in perm)
    return lowering.finish(jnp.transpose(lowering.prepare(x), perm), out, tuple(axes[i] for i in perm))


_TOKEN = re.compile(r"\(\s*(?:([A-Za-z_]\w*)\s*:)?([^()]*)\)|([^\s()]+)")


def _side(text: str) -> list[tuple[str | None, list[str], bool]]:
    """Entries of one side of a pattern: (group name, atoms, parenthesised)."""
    try:
        ParsedExpression(re.sub(r"[A-Za-z_]\w*\s*:", "", text))
    except EinopsError as e:
        raise ShapeError(f"rearrange: {e}", op="rearrange") from None
    entries: list[tuple[str | None, list[str], bool]] = []
    for m in _TOKEN.finditer(text):
        if m.group(3) is not None:
            entries.append((None, [m.group(3)], False))
        else:
            entries.append((m.group(1), m.group(2).split(), True))
    return entries


@op("rearrange")
def rearrange(x: Tensor, pattern: str, /, **sizes: int | Dim) -> Tensor:
    """Reshape and reorder by an einops pattern over dim names.

    The left side lists ``x``'s dims in order; ``(heads d_kv)`` splits the dim at that place into
    new dims (sizes from ``sizes``, one may be inferred). The right side orders the dims and merges
    groups, each named: ``(d_model: heads d_kv)``. A left group may be named too, to check it.
    ``rearrange(x, "batch (heads d_kv) -> batch heads d_kv", heads=8)``. ``x`` and ``pattern``
    are positional, so a dim may be called ``x`` or ``pattern``.
    """
    if pattern.count("->") != 1:
        raise ShapeError(f"rearrange: pattern {pattern!r} needs exactly one '->'", op="rearrange")
    left_text, right_text = pattern.split("->")
    left, right = _side(left_text), _side(right_text)
    if len(left) != x.shape.rank:
        raise ShapeError(
            f"rearrange: left side {left_text.strip()!r} has {len(left)} entries but {x.shape} has {x.shape.rank} dims",
            op="rearrange",
        )
    atoms: dict[str, Dim] = {}
    for (name, names, grouped), d in zip(left, x.shape):
        if (name or (names[0] if not grouped else d.name)) != d.name:
            raise ShapeError(
                f"rearrange: left side names {name or names[0]!r} where {x.shape} has dim {d.name!r}", op="rearrange"
            )
        if not grouped:
            atoms[d.name] = d
            continue
        known = {n: (s.size if isinstance(s, Dim) else int(s)) for n, s in sizes.items() if n in names}
        unknown = [n for n in names if n not in known]
        product = 1
        for s in known.values():
            product *= s
        if len(unknown) > 1 or (not unknown and product != d.size) or (unknown and (product == 0 or d.size % product)):
            raise ShapeError(f"rearrange: cannot split {d} into {names} with sizes {known}", op="rearrange")
        for n in names:
            atoms[n] = Dim(n, known.get(n, d.size // product if product else 0))
    order: list[str] = []
    out: list[Dim] = []
    for name, names, grouped in right:
        missing = [n for n in names if n not in atoms]
        if missing:
            raise ShapeError(
                f"rearrange: right side names {missing}, which the left side does not have", op="rearrange"
            )
        if grouped and name is None:
            raise ShapeError(
                f"rearrange: name the merged dim, e.g. ({'_'.join(names)}: {' '.join(names)})", op="rearrange"
            )
        order.extend(names)
        size = 1
        for n in names:
            size *= atoms[n].size
        out.append(atoms[names[0]] if name is None else Dim(name, size))  # a group has a name (checked above)
    if sorted(order) != sorted(atoms):
        raise ShapeError(
            f"rearrange: right side must use each dim of the left once: {sorted(atoms)} vs {order}", op="rearrange"
        )
    y = x
    split = Shape(atoms.values())
    if split != y.shape:
        y = reshape(y, split)
    if list(order) != list(y.shape.names):
        y = transpose(y, order)
    return y if Shape(out) == y.shape else reshape(y, Shape(out))
