"""``md.einsum``: contraction by dim name.

Dims absent from ``out`` are summed. Locally it is one ``jnp.einsum`` on the shards; a summed dim
that is split leaves partial sums over its mesh axes, added by one ``psum`` when a later op needs
the value (or by ``psum_scatter`` when the result is split over that same axis), and kept pending
through additions of such results.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshdsl.dims import Dim, DimLike, Shape
from meshdsl.errors import ShapeError
from meshdsl.lowering import compute_split
from meshdsl.lowering.context import current, op
from meshdsl.tensor import Tensor, describe


def _output_shape(tensors: Sequence[Tensor], out: Sequence[DimLike] | Shape | str | None) -> Shape:
    dims: dict[str, Dim] = {}
    count: dict[str, int] = {}
    for t in tensors:
        for d in t.shape:
            if d.name in dims and dims[d.name].size != d.size:
                shapes = ", ".join(str(x.shape) for x in tensors)
                raise ShapeError(
                    f"einsum: dim {d.name} has size {dims[d.name].size} in one input and {d.size} in another "
                    f"({shapes})",
                    op="einsum",
                )
            dims.setdefault(d.name, d)
            count[d.name] = count.get(d.name, 0) + 1
    if out is None:
        return Shape(d for n, d in dims.items() if count[n] == 1)
    if not isinstance(out, (str, Dim, Shape, list, tuple)):
        raise ShapeError(
            f"einsum: out must be dims (names, md.Dims, a Shape or a string of names), got {describe(out)}", op="einsum"
        )
    items = out.split() if isinstance(out, str) else [out] if isinstance(out, Dim) else list(out)
    names = [item.name if isinstance(item, Dim) else item for item in items]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ShapeError(f"einsum output {names} repeats dim name(s) {', '.join(repeated)}", op="einsum")
    result = []
    for item in items:
        name = item.name if isinstance(item, Dim) else item
        if name not in dims:
            inputs = ", ".join(str(t.shape) for t in tensors)
            raise ShapeError(f"einsum output names dim {name!r}, which no input has (inputs: {inputs})", op="einsum")
        if isinstance(item, Dim) and item.size != dims[name].size:
            raise ShapeError(f"einsum output dim {item} does not match the inputs' {dims[name]}", op="einsum")
        result.append(dims[name])
    return Shape(result)


def _pairwise(tensors: Sequence[Tensor], out_shape: Shape) -> Tensor | None:
    """An einsum of three or more operands as einsums of two, in the order ``jnp.einsum`` contracts
    them on the global arrays (opt_einsum's path for the global shapes).

    The order decides NaN against inf (``(h v) w`` and ``h (v w)`` differ where an inf meets a
    zero), and one local einsum would take the path opt_einsum picks for the blocks' shapes, with
    partial sums of a split dim multiplied before they are added (issue 31). Each pair's summed
    dims are added before the next product. None where the path contracts three at once."""
    names = list(dict.fromkeys(n for t in tensors for n in t.shape.names))
    letters = {n: string.ascii_letters[i] for i, n in enumerate(names)}
    spec = ",".join("".join(letters[n] for n in t.shape.names) for t in tensors)
    spec += "->" + "".join(letters[n] for n in out_shape.names)
    shapes: list[Any] = [jax.ShapeDtypeStruct(t.shape.sizes, t.dtype) for t in tensors]  # shapes are all it reads
    path = jnp.einsum_path(spec, *shapes, optimize="auto")[0]
    if any(len(step) > 2 for step in path):  # jnp contracts them at once too
        return None
    ops = list(tensors)
    for step in path:
        picked = [ops[i] for i in sorted(step)]
        for i in sorted(step, reverse=True):
            ops.pop(i)
        if not ops:
            return einsum(*picked, out=out_shape)
        needed = {n for t in ops for n in t.shape.names} | set(out_shape.names)
        ops.append(
            einsum(*picked, out=[n for n in dict.fromkeys(n for t in picked for n in t.shape.names) if n in needed])
        )
    return einsum(*ops, out=out_shape)


def _lone_sums_first(lowering, tensors: Sequence[Tensor], out_shape: Shape) -> tuple[Tensor, ...]:
    """``tensors`` with each one's *lone* summed dims (in no other input, not in ``out``) summed first
    where one of them is split, as ``jnp.einsum`` sums them on the global array before it multiplies.

    Multiplying a partial sum and adding the products after is the same number for finite values,
    not for all: ``inf * (0 + 3)`` is ``inf``, ``inf * 0 + inf * 3`` is NaN; so a split of a lone dim
    would change NaN and inf results (issue 31). Summed first, the operand's partial sums are added
    (one ``psum`` of the smaller, reduced operand) before any product is formed."""
    from meshdsl.ops.reduction import reduce_sum

    counts: dict[str, int] = {}
    for t in tensors:
        for n in t.shape.names:
            counts[n] = counts.get(n, 0) + 1
    done = []
    for t in tensors:
        lone = [n for n in t.shape.names if counts[n] == 1 and n not in out_shape]
        split = dict(zip(t.shape.names, lowering.split_of(t)))
        rules = dict(zip(t.shape.names, lowering.axes(t.shape)))
        done.append(reduce_sum(t, lone) if any(split[n] or rules[n] for n in lone) else t)
    return tuple(done)


@op("einsum")
def einsum(*tensors: Tensor, out: Sequence[DimLike] | Shape | str | None = None) -> Tensor:
    """Multiply ``tensors`` and sum over every dim not in ``out``.

    ``out`` is a list of Dims or names, a Shape, or a space-separated string; by default the dims
    that appear in exactly one input.
    """
    if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)):
        tensors = tuple(tensors[0])
    if not tensors:
        raise ShapeError("einsum: needs at least one md tensor, got none", op="einsum")
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise ShapeError(f"einsum: input {i} must be an md tensor, got {describe(t)}", op="einsum")
    lowering = current()
    out_shape = _output_shape(tensors, out)
    if len(tensors) > 2 and (paired := _pairwise(tensors, out_shape)) is not None:
        return paired
    tensors = _lone_sums_first(lowering, tensors, out_shape)
    summed = [n for n in dict.fromkeys(n for t in tensors for n in t.shape.names) if n not in out_shape]

    def result(split: compute_split.NameAxes):
        return tuple(split[n] for n in out_shape.names), tuple(a for n in summed for a in split[n])

    itemsize = np.dtype(jnp.result_type(*(t.dtype for t in tensors))).itemsize
    split = compute_split.choose(lowering, tensors, out_shape, result, itemsize)
    letters = {
        n: string.ascii_letters[i] for i, n in enumerate(dict.fromkeys(n for t in tensors for n in t.shape.names))
    }
    spec = ",".join("".join(letters[n] for n in t.shape.names) for t in tensors)
    spec += "->" + "".join(letters[n] for n in out_shape.names)
    arrays = [lowering.prepare(t, tuple(split[n] for n in t.shape.names), beside=tensors) for t in tensors]
    out_axes, pending = result(split)
    return lowering.finish(jnp.einsum(spec, *arrays), out_shape, out_axes, pending, lazy=True)
