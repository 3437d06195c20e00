"""Hypothesis strategies: meshes, dim sizes, layouts and input tensors.

Sizes come from {2, 4, 8, 16, 6, 12}, so splits over axes of size 2, 4 and 8 often divide and
sometimes do not. A drawn layout gives each dim one of: unsplit, one mesh axis, or an ordered
pair of axes. Most choices are legal by construction (the axes divide the size and are not yet
used by another dim); some reuse an axis another dim holds (legal when the two dims never meet
in one tensor, which is the case that makes an op choose its compute layout) and a few ignore
divisibility, so the harness also sees layouts meshdsl must reject.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

import harness
import numpy as np
from hypothesis import settings
from hypothesis import strategies as st

import meshdsl as md

SIZES = (2, 4, 8, 16, 6, 12)
DIM_NAMES = ("batch", "seq", "d_model", "heads", "d_ff", "vocab")


def examples(n: int) -> int:
    """How many examples a test that asks for ``n`` runs: ``n`` in CI, 10x ``n`` under the fuzz
    profile (the active profile's ``max_examples`` read as a percentage; see conftest.py)."""
    return max(1, n * settings.default.max_examples // 100)


def meshes() -> st.SearchStrategy[md.Mesh]:
    return st.sampled_from(list(harness.MESHES)).map(harness.mesh)


def sizes() -> st.SearchStrategy[int]:
    return st.sampled_from(SIZES)


def dim_pool(n: int = 4) -> st.SearchStrategy[dict[str, int]]:
    """``n`` distinct dim names with drawn sizes, e.g. ``{"batch": 8, "seq": 6, ...}``."""
    return st.permutations(DIM_NAMES).flatmap(
        lambda names: st.fixed_dictionaries({name: sizes() for name in names[:n]})
    )


@st.composite
def sub_shape(draw, pool: Mapping[str, int], min_rank: int = 1, max_rank: int = 3) -> dict[str, int]:
    """A few dims of ``pool``, in a drawn order."""
    names = draw(st.permutations(list(pool)))
    rank = draw(st.integers(min_rank, min(max_rank, len(names))))
    return {n: pool[n] for n in names[:rank]}


def axis_choices(mesh: md.Mesh, max_axes: int = 2) -> list[tuple[str, ...]]:
    """Unsplit, every axis, every ordered pair of axes (and, up to ``max_axes``, triples ...)."""
    axes = mesh.axis_names
    return [(), *(p for k in range(1, max_axes + 1) for p in itertools.permutations(axes, k))]


@st.composite
def dim_axes(
    draw, mesh: md.Mesh, size: int, taken: set[str], like: tuple[str, ...] = (), share: float = 0.2
) -> tuple[str, ...]:
    """Split for one dim of ``size``, always dividing it: unsplit, an axis, or an ordered pair or
    triple of axes. With probability ``share`` they may include axes other dims hold (``taken``):
    legal while the two dims never meet in one tensor, the case where an op chooses its compute
    layout. ``like``: a related dim's axes (a merged dim split like its leading part), drawn
    half the time when they qualify.
    """
    options = [o for o in axis_choices(mesh, 3) if size % math.prod(mesh.axis_sizes[a] for a in o) == 0]
    if draw(st.integers(0, 99)) >= 100 * share:
        options = [o for o in options if not taken & set(o)]
    if like in options and like and draw(st.booleans()):
        return like
    return draw(st.sampled_from(options))


@st.composite
def layouts(draw, mesh: md.Mesh, pool: Mapping[str, int], risk: float = 0.1) -> md.Layout:
    """A layout for the dims of ``pool`` on ``mesh``; mostly legal (see the module docstring).

    Each dim takes a risky choice with probability ``risk``: three times in four axes another
    dim may hold too, once in four any axes at all (which may not divide the size).
    """
    rules: dict[str, tuple[str, ...]] = {}
    used: set[str] = set()
    sizes_ = dict(mesh.axis_sizes)
    for name, size in pool.items():
        mode = draw(st.integers(0, 99)) / 100
        options = axis_choices(mesh)
        if mode >= risk / 4:  # dividing the size
            options = [o for o in options if size % math.prod(sizes_[a] for a in o) == 0]
        if mode >= risk:  # and on axes no other dim holds
            options = [o for o in options if not used & set(o)]
        axes = draw(st.sampled_from(options))
        used.update(axes)
        if axes:
            rules[name] = axes
    return md.Layout(rules)


@st.composite
def legal_axes(draw, mesh: md.Mesh, shape: Sequence[int], exclude: Sequence[str] = ()) -> tuple[tuple[str, ...], ...]:
    """Per-dim split axes for a tensor of ``shape``: each axis used once, dividing, none in ``exclude``."""
    out = []
    used = set(exclude)
    for size in shape:
        options = [
            o for o in axis_choices(mesh) if not used & set(o) and size % math.prod(mesh.axis_sizes[a] for a in o) == 0
        ]
        axes = draw(st.sampled_from(options))
        used.update(axes)
        out.append(axes)
    return tuple(out)


def backends() -> st.SearchStrategy[tuple[str, ...]]:
    """The backends an example is checked on: spmd (meshdsl's own collectives) always, gspmd (sharding
    constraints, XLA's partitioner) in about half the examples, which keeps the suite near 15 minutes."""
    return st.sampled_from([harness.BACKENDS, ("spmd",)])


SPECIAL_SHARES = (0.0, 0.0, 0.0, 0.05, 0.0, 0.0, 0.0, 0.3)
"""Shares of input entries :func:`harness.sprinkle` makes NaN, +-inf or -0.0, one drawn per example:
none in three examples of four, a few or many in the rest (a layout must carry them as ``jnp`` does).
The random programs pick one by their seed (an extra draw would change every program CI checks)."""


def specials() -> st.SearchStrategy[float]:
    """One of :data:`SPECIAL_SHARES`."""
    return st.sampled_from(list(SPECIAL_SHARES))


def rngs() -> st.SearchStrategy[np.random.Generator]:
    """A numpy generator for input values (values need no shrinking, only a reproducible seed)."""
    return st.integers(0, 2**16).map(np.random.default_rng)


# ---- helpers for the reshape, concat, indexing, random and scan tests ----


def factor_pairs(size: int) -> list[tuple[int, int]]:
    """``(p, q)`` with ``p * q == size`` and both at least 2 (a dim that can be cut in two)."""
    return [(p, size // p) for p in range(2, size // 2 + 1) if size % p == 0]


@st.composite
def layouts_any_order(draw, mesh: md.Mesh, pool: Mapping[str, int], risk: float = 0.1) -> md.Layout:
    """:func:`layouts` over ``pool`` taken in a drawn order, so that no dim always chooses its axes first."""
    names = draw(st.permutations(list(pool)))
    return draw(layouts(mesh, {n: pool[n] for n in names}, risk))


def group_size(mesh: md.Mesh, layout: md.Layout, name: str) -> int:
    """Devices the dim called ``name`` is split over under ``layout`` (1: unsplit)."""
    return math.prod(mesh.axis_sizes[a] for a in layout.rules.get(name, ()))


@st.composite
def layouts_splitting(
    draw, mesh: md.Mesh, pool: Mapping[str, int], name: str, risk: float = 0.05, p_split: float = 0.75
) -> md.Layout:
    """:func:`layouts_any_order`, but ``name`` is split with probability ``p_split`` (over one axis or a
    pair that divides its size); other dims then give up the axes ``name`` took."""
    base = draw(layouts_any_order(mesh, pool, risk))
    options = [o for o in axis_choices(mesh) if o and pool[name] % math.prod(mesh.axis_sizes[a] for a in o) == 0]
    if not options or draw(st.integers(0, 99)) >= 100 * p_split:
        return base
    axes = draw(st.sampled_from(options))
    rules = {n: a for n, a in base.rules.items() if n != name and not set(a) & set(axes)}
    rules[name] = axes
    return md.Layout(rules)
