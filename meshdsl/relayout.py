"""Relayout: move one tensor from layout A to layout B on the mesh. The one place this rule lives.

A tensor's local layout is, per dim, the ordered tuple of mesh axes that split it (major to
minor), plus the axes over which its local values are still partial sums waiting to be added
(Mesh-TF's LazyAllreduceSum). :func:`plan` turns a source and a destination split into steps and
:func:`step_bytes` prices them; :mod:`meshdsl.lowering.relayout_run` runs them on a local shard inside
``shard_map``. This module is pure (no JAX tracing): the lowering, ``md.explain`` and the planner all
plan and price through here.

The steps: a local slice (adds axes at a dim's minor end; free), ``psum`` (adds pending sums),
``psum_scatter`` (adds pending sums, their axes at a dim's minor end), ``all_gather`` (removes a
dim's innermost axes) and ``all_to_all`` (moves a dim's innermost axes to another dim's minor
end), each over any group of axes at once, added in any order. Only these keep every shard one
contiguous block per device, the layouts this module knows.

:func:`plan` returns the cheapest sequence: fewest bytes per device as :func:`step_bytes` prices
them (ring model, :mod:`meshdsl.collectives`), then fewest collectives, then fewest steps, then
the first in a fixed order (slice < psum < psum_scatter < all_to_all < all_gather, then by dim and
axis names). Greedy rules cannot get there: a step costs a fraction of the local buffer around
it, so slicing early (free, shrinks later buffers), reduce-scattering rather than all-reducing and
gathering last all pay, and one collective over several axes can cost less than one per axis
(an all-to-all over 2 x 2 devices moves 3/4 of the buffer, two over 2 move 1/2 + 1/2). So
:func:`plan` searches: the states are the local layouts of the tensor over the mesh axes the
relayout touches (each axis unused, pending, or splitting one dim at some position, every dim
divisible by its axes), the moves are the steps above, each priced exactly; Dijkstra backwards
from the destination prices every state, and the plan walks from the source along cheapest
moves. The graph, the prices and the plans are cached: the lowering asks for the same
relayouts again and again. tests/test_relayout.py proves the optimum by brute force.

Only the axes of the source, the destination and the pending sums take part. Along any other
axis the relayout cannot assume the tensor's values agree (inside a pipeline stage they differ
from stage to stage), so it never slices and re-gathers over one to share the work of a sum.

Worked example: an f32 ``[m=64, n=16]`` tensor (4,096 bytes) on ``data=4 model=2``, from
``(("data",), ())`` to ``(("model", "data"), ())``. Dim ``m`` must get ``model`` in front of the
``data`` it has, and only a dim's minor end can change, so ``data`` has to leave ``m`` and come back:

1. slice ``n`` over ``model``: the local block shrinks from 1,024 to 512 bytes, free;
2. ``all_to_all`` of ``data`` from ``m`` to ``n`` (now ``("model", "data")``): 3/4 x 512 = 384 bytes;
3. ``all_to_all`` of ``("model", "data")`` from ``n`` to ``m``: 7/8 x 512 = 448 bytes.

832 bytes in all, where gathering ``data`` and slicing again moves 3/4 x 4,096 = 3,072.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import heapq
import itertools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax.numpy as jnp

from meshdsl.collectives import Collective, bytes_moved
from meshdsl.layout import Split


class StepKind(enum.Enum):
    """What one relayout step does to the local shard."""

    PSUM = "psum"
    PSUM_SCATTER = "psum_scatter"
    ALL_GATHER = "all_gather"
    ALL_TO_ALL = "all_to_all"
    SLICE = "slice"

    @property
    def collective(self) -> Collective | None:
        return _COLLECTIVE[self]


_COLLECTIVE = {
    StepKind.PSUM: Collective.ALL_REDUCE,
    StepKind.PSUM_SCATTER: Collective.REDUCE_SCATTER,
    StepKind.ALL_GATHER: Collective.ALL_GATHER,
    StepKind.ALL_TO_ALL: Collective.ALL_TO_ALL,
    StepKind.SLICE: None,
}


@dataclasses.dataclass(frozen=True)
class Step:
    """One step: ``kind`` over mesh ``axes`` on tensor dim ``dim``.

    ``dim`` is the dim that is scattered, gathered or sliced (for ``ALL_TO_ALL`` the dim that
    gains the split; ``from_dim`` the one that loses it). ``PSUM`` has no dim. ``axes`` are in
    the order the dim gains them (a gather: the order the dim held them). An ``ALL_TO_ALL`` takes
    the innermost ``len(axes)`` axes of ``from_dim``; ``from_axes`` is their order there when it
    is not that of ``axes`` (``()`` when it is).
    """

    kind: StepKind
    axes: tuple[str, ...]
    dim: int = -1
    from_dim: int = -1
    from_axes: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class State:
    """A local layout: per-dim split axes and the axes of pending partial sums."""

    axes: Split
    pending: tuple[str, ...] = ()

    def after(self, step: Step) -> State:
        axes = [list(a) for a in self.axes]
        pending = list(self.pending)
        if step.kind is StepKind.PSUM:
            pending = [a for a in pending if a not in step.axes]
        elif step.kind is StepKind.PSUM_SCATTER:
            pending = [a for a in pending if a not in step.axes]
            axes[step.dim].extend(step.axes)
        elif step.kind is StepKind.ALL_GATHER:
            del axes[step.dim][len(axes[step.dim]) - len(step.axes) :]
        elif step.kind is StepKind.ALL_TO_ALL:
            del axes[step.from_dim][len(axes[step.from_dim]) - len(step.axes) :]
            axes[step.dim].extend(step.axes)
        else:
            axes[step.dim].extend(step.axes)
        return State(tuple(map(tuple, axes)), tuple(pending))


_Node = tuple[Split, tuple[str, ...]]
"""A local layout in the search: per-dim axes, and the pending axes in the search's canonical order."""

_Key = tuple[int, int, int]
"""A plan's price: bytes (in units of ``G / M**2``: ``G`` the tensor's bytes, ``M`` the product of the
searched axes' sizes, so every step's price is an exact integer), collectives, steps."""

_RANK = {StepKind.SLICE: 0, StepKind.PSUM: 1, StepKind.PSUM_SCATTER: 2, StepKind.ALL_TO_ALL: 3, StepKind.ALL_GATHER: 4}


def _order(step: Step) -> tuple:
    """The deterministic order among steps that start equally cheap plans: slices first, gathers last."""
    return (_RANK[step.kind], step.dim, step.from_dim, step.axes, step.from_axes)


def _add(a: _Key, b: _Key) -> _Key:
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2])


def _replace(axes: Split, changed: Mapping[int, tuple[str, ...]]) -> Split:
    return tuple(changed.get(d, a) for d, a in enumerate(axes))


@dataclasses.dataclass(frozen=True)
class _Space:
    """Every local layout of a tensor of global ``sizes`` over the mesh axes ``axes`` (name, size)."""

    sizes: tuple[int, ...]
    axes: tuple[tuple[str, int], ...]

    @functools.cached_property
    def axis_sizes(self) -> dict[str, int]:
        return dict(self.axes)

    def fits(self, dim: int, axes: Sequence[str]) -> bool:
        """Whether dim ``dim`` divides evenly over ``axes``."""
        return self.sizes[dim] % group_size(axes, self.axis_sizes) == 0

    def nodes(self) -> Iterator[_Node]:
        """Each axis unused, pending or splitting one dim (in any order within the dim), where it divides."""
        names = [a for a, _ in self.axes]
        rank = len(self.sizes)
        for places in itertools.product(range(-2, rank), repeat=len(names)):
            pending = tuple(a for a, p in zip(names, places) if p == -1)
            groups = [[a for a, p in zip(names, places) if p == d] for d in range(rank)]
            for axes in itertools.product(*(itertools.permutations(g) for g in groups)):
                if all(self.fits(d, a) for d, a in enumerate(axes)):
                    yield tuple(axes), pending

    def moves(self, node: _Node) -> Iterator[tuple[Step, _Node, _Key]]:
        """Every single step from ``node``, the layout it leads to and its price.

        Slices take one axis (a slice over several is the same slices in a row); sums, scatters,
        gathers and all-to-alls take any legal group of axes at once, since one collective over
        several axes can cost less than one per axis.
        """
        axes, pending = node
        sizes = self.axis_sizes
        m = math.prod(sizes.values())
        split = math.prod(sizes[a] for d in axes for a in d)

        def price(kind: Collective, over: Sequence[str], split_in: int, split_out: int) -> _Key:
            """:func:`bytes_moved` from a local buffer of ``G / split_in`` bytes to one of ``G / split_out``, in
            units of ``G / M**2``: an integer, as ``M`` is a multiple of the group and of both splits."""
            moved = bytes_moved(kind, m * m // split_in, m * m // split_out, group_size(over, sizes))
            return (int(moved), 1, 1)

        used = {a for d in axes for a in d} | set(pending)
        for d, have in enumerate(axes):
            for a in sizes:
                if a not in used and self.fits(d, have + (a,)):
                    yield Step(StepKind.SLICE, (a,), d), (_replace(axes, {d: have + (a,)}), pending), (0, 0, 1)
        for k in range(1, len(pending) + 1):
            for summed in itertools.combinations(pending, k):
                rest = tuple(a for a in pending if a not in summed)
                yield Step(StepKind.PSUM, summed), (axes, rest), price(Collective.ALL_REDUCE, summed, split, split)
                for order in itertools.permutations(summed):
                    for d, have in enumerate(axes):
                        if self.fits(d, have + order):
                            yield (
                                Step(StepKind.PSUM_SCATTER, order, d),
                                (_replace(axes, {d: have + order}), rest),
                                price(Collective.REDUCE_SCATTER, order, split, split * group_size(order, sizes)),
                            )
        for i, have in enumerate(axes):
            for k in range(1, len(have) + 1):
                moved, kept = have[-k:], have[:-k]
                gathered = split // group_size(moved, sizes)
                yield (
                    Step(StepKind.ALL_GATHER, moved, i),
                    (_replace(axes, {i: kept}), pending),
                    price(Collective.ALL_GATHER, moved, split, gathered),
                )
                for j, other in enumerate(axes):
                    if j == i:
                        continue
                    for order in itertools.permutations(moved):
                        if self.fits(j, other + order):
                            step = Step(StepKind.ALL_TO_ALL, order, j, i, () if order == moved else moved)
                            after = (_replace(axes, {i: kept, j: other + order}), pending)
                            yield step, after, price(Collective.ALL_TO_ALL, moved, split, split)


@dataclasses.dataclass(frozen=True)
class _Graph:
    """The moves out of and into every layout of a :class:`_Space`."""

    out: Mapping[_Node, tuple[tuple[Step, _Node, _Key], ...]]
    into: Mapping[_Node, tuple[tuple[_Node, _Key], ...]]


@functools.lru_cache(maxsize=256)
def _graph(space: _Space) -> _Graph:
    out = {node: tuple(space.moves(node)) for node in space.nodes()}
    into: dict[_Node, list[tuple[_Node, _Key]]] = {node: [] for node in out}
    for node, moves in out.items():
        for _, after, key in moves:
            into[after].append((node, key))
    return _Graph(out, {node: tuple(edges) for node, edges in into.items()})


@functools.lru_cache(maxsize=4096)
def _cheapest_to(space: _Space, goal: _Node) -> Mapping[_Node, _Key]:
    """The price of the cheapest plan from every layout of ``space`` to ``goal`` (Dijkstra, backwards)."""
    into = _graph(space).into
    best: dict[_Node, _Key] = {goal: (0, 0, 0)}
    queue: list[tuple[_Key, _Node]] = [((0, 0, 0), goal)]
    while queue:
        key, node = heapq.heappop(queue)
        if key != best[node]:
            continue
        for before, step_key in into[node]:
            total = _add(step_key, key)
            if before not in best or total < best[before]:
                best[before] = total
                heapq.heappush(queue, (total, before))
    return best


def _merge_slices(steps: Iterable[Step]) -> tuple[Step, ...]:
    """Slices of one dim in a row as one slice over their axes together."""
    out: list[Step] = []
    for step in steps:
        if out and step.kind is StepKind.SLICE and out[-1].kind is StepKind.SLICE and out[-1].dim == step.dim:
            out[-1] = Step(StepKind.SLICE, out[-1].axes + step.axes, step.dim)
        else:
            out.append(step)
    return tuple(out)


@functools.lru_cache(maxsize=1 << 14)
def _plan(space: _Space, start: _Node, goal: _Node) -> tuple[Step, ...]:
    cheapest = _cheapest_to(space, goal)
    out = _graph(space).out
    if start not in out:
        raise ValueError(
            f"relayout from {start[0]} with pending sums over {start[1]}: not a legal layout of sizes {space.sizes}"
        )
    steps = []
    node = start
    while node != goal:
        step, node = min(
            (
                (step, after)
                for step, after, key in out[node]
                if after in cheapest and _add(key, cheapest[after]) == cheapest[node]
            ),
            key=lambda move: _order(move[0]),
        )
        steps.append(step)
    return _merge_slices(steps)


def plan(
    src: Split, dst: Split, pending: Iterable[str], sizes: Sequence[int], axis_sizes: Mapping[str, int]
) -> tuple[Step, ...]:
    """The cheapest steps that turn a shard laid out as ``src`` (with ``pending`` sums) into one laid out as ``dst``.

    ``sizes``: the tensor's global dim sizes; ``axis_sizes``: the mesh's. Cheapest: fewest bytes
    per device as :func:`step_bytes` prices them, then fewest collectives, then fewest steps, then
    the first in a fixed order of steps (see the module docstring).
    """
    if len(src) != len(dst):
        raise ValueError(f"relayout between ranks {len(src)} and {len(dst)}")
    if len(sizes) != len(src):
        raise ValueError(f"relayout of a rank-{len(src)} layout given {len(sizes)} sizes")
    pending = tuple(pending)
    touched = {a for dims in (src, dst) for d in dims for a in d} | set(pending)
    axes = tuple((a, n) for a, n in axis_sizes.items() if a in touched)
    if len(axes) < len(touched):
        raise ValueError(f"relayout over axes {sorted(touched - dict(axes).keys())} the mesh {dict(axis_sizes)} lacks")
    order = [a for a, _ in axes]
    start = (tuple(map(tuple, src)), tuple(sorted(pending, key=order.index)))
    goal = (tuple(map(tuple, dst)), ())
    space = _Space(tuple(sizes), axes)
    if goal not in _graph(space).out:
        raise ValueError(f"relayout to {goal[0]}: not a legal layout of sizes {space.sizes}")
    return _plan(space, start, goal)


def group_size(axes: Iterable[str], axis_sizes: Mapping[str, int]) -> int:
    """Devices in one group of a collective over ``axes``."""
    return math.prod(axis_sizes[a] for a in axes)


def local_sizes(sizes: Sequence[int], axes: Split, axis_sizes: Mapping[str, int]) -> tuple[int, ...]:
    """Shard sizes of a tensor of global ``sizes`` laid out as ``axes``."""
    return tuple(s // group_size(a, axis_sizes) for s, a in zip(sizes, axes))


def narrower(dtype: Any, grad_dtype: Any) -> bool:
    """Whether gradients of a ``dtype`` value are summed in ``grad_dtype``: a float, narrower than it."""
    return (
        grad_dtype is not None
        and jnp.issubdtype(dtype, jnp.floating)
        and jnp.dtype(grad_dtype).itemsize < jnp.dtype(dtype).itemsize
    )


def step_bytes(
    steps: Sequence[Step],
    start: State,
    sizes: Sequence[int],
    itemsize: int,
    axis_sizes: Mapping[str, int],
) -> list[float]:
    """Bytes each step moves per device, for a tensor of global ``sizes`` starting laid out as ``start``."""
    out = []
    state = start
    for step in steps:
        before = math.prod(local_sizes(sizes, state.axes, axis_sizes)) * itemsize
        state = state.after(step)
        after = math.prod(local_sizes(sizes, state.axes, axis_sizes)) * itemsize
        collective = step.kind.collective
        if collective is None:
            out.append(0.0)
            continue
        out.append(float(bytes_moved(collective, before, after, group_size(step.axes, axis_sizes))))
    return out
