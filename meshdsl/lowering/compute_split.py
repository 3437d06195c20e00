"""The compute split of an op: the axes it computes with, when its operands' splits clash.

Every tensor is laid out by its dims' names, so two operands always agree on a shared dim. But an
op with several operands can meet two different dims split over the same mesh axis: in
``einsum(x[d_model], y[batch])`` with ``d_model:model; batch:model`` the local einsum of the two
shards would pair the wrong blocks. One of the two dims must give up that axis. :func:`choose`
tries each choice and keeps the one whose relayouts (of the operands, and of the result back to
its own layout) move the fewest bytes, priced by :mod:`meshdsl.relayout`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from meshdsl import relayout
from meshdsl.dims import Shape
from meshdsl.layout import Split
from meshdsl.lowering.base import Lowering
from meshdsl.tensor import Tensor

NameAxes = dict[str, tuple[str, ...]]
"""A compute split: per dim name, the mesh axes one op computes with (not a ``Layout``: one op's choice)."""
ResultSplit = Callable[[NameAxes], tuple[Split, tuple[str, ...]]]
"""Given a compute split, the result's local split and pending sums."""


def _moved(lowering: Lowering, shape: Shape, src: Split, dst: Split, pending: Sequence[str], itemsize: int) -> float:
    steps = relayout.plan(src, dst, pending, shape.sizes, lowering.axis_sizes)
    start = relayout.State(src, tuple(pending))
    return sum(relayout.step_bytes(steps, start, shape.sizes, itemsize, lowering.axis_sizes))


def choose(lowering: Lowering, operands: Sequence[Tensor], out: Shape, result: ResultSplit, itemsize: int) -> NameAxes:
    """Per dim name, the axes to compute with: the operands' own splits, each mesh axis kept by one dim.

    ``result`` maps such a choice to the result's local layout and pending sums.
    """
    own: NameAxes = {}
    for t in operands:
        own.update(zip(t.shape.names, lowering.axes(t.shape)))
    claims: dict[str, list[str]] = {}
    for name, axes in own.items():
        for a in axes:
            claims.setdefault(a, []).append(name)
    clashes = {a: names for a, names in claims.items() if len(names) > 1}
    if not clashes:
        return own
    best: tuple[float, NameAxes] | None = None
    for owners in itertools.product(*clashes.values()):
        keep = dict(zip(clashes, owners))
        chosen = {n: tuple(a for a in axes if keep.get(a, n) == n) for n, axes in own.items()}
        cost = sum(
            _moved(
                lowering, t.shape, lowering.split_of(t), tuple(chosen[n] for n in t.shape.names), t.pending, itemsize
            )
            for t in operands
        )
        out_axes, pending = result(chosen)
        cost += _moved(lowering, out, out_axes, lowering.axes(out), pending, itemsize)
        if best is None or cost < best[0]:
            best = (cost, chosen)
    assert best is not None  # clashes is not empty, so at least one choice was priced
    return best[1]
