"""The random-program generator: chains of ops from every op family, on a drawn mesh and layout.

A *chain* starts from one input and applies a few *steps*; a step is one op of a family (or a
small composite: a ``jax.checkpoint`` or an ``md.scan`` around drawn sub-steps), written twice:
with meshdsl, and with :mod:`reference` on global arrays. Steps bring fresh inputs (the other
operand of an add, an einsum's weight, gather indices) and may emit side results (the indices of
a top_k, the other parts of a split), which are results of the chain too. A test packs several
chains into one compiled function and checks it with :func:`harness.check`.

The layout is drawn with the program. Each dim of the example's pool gets axes first (see
:func:`strategies.dim_axes`: unsplit, one axis, an ordered pair or triple, sometimes axes another
dim holds); an op that creates a dim draws its axes then; an op that resizes a dim (slice, pad,
concat, split) keeps the size a multiple of the dim's split. Two dims that hold one axis are legal
until they meet in one tensor: :func:`legal_layout` drops the later rule of every pair that meets
in a tensor the reference makes.

Ties and kinks. A max, min, top_k or argmax that meets equal values, and a relu, abs, comparison
or maximum that meets a value at its kink, has a gradient (or an index) that float32 rounding may
flip. So each value records whether it may hold *ties* (a value repeated along a dim: a broadcast
of a constant, relu's zeros, a pad, a gather); an extremum never applies to such a value (the
ties would be exact, and an extremum's gradient goes to the first tied entry, where jnp's splits
evenly: a known difference, see test_reduction.py). Near ties and near kinks of random data are caught by the
reference: :func:`apart` raises :class:`NearKink` when two values it is told to tell apart are
within ``MARGIN`` (relative to ``max(1, |values|)``); the test then draws other input values.

Values stay comparable with the float64 reference at the harness tolerance: inputs are standard
normal, einsum and conv results are divided by the square root of the number of terms summed,
and element-wise functions that could grow without bound are applied to bounded arguments.

Adding an op family: write ``build(ctx, value) -> Step | None`` (None: it does not apply to this
value) and add it to :data:`FAMILIES`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import harness
import jax
import jax.numpy as jnp
import numpy as np
import reference as R
import strategies as S
from hypothesis import strategies as st
from reference import Named

import meshdsl as md

MAX_RANK = 3
MARGIN = 2e-5
"""Two values an op must tell apart differ by at least this, relative to ``max(1, |values|)``:
twice the harness tolerance, so that values within tolerance of the reference decide alike."""


class NearKink(Exception):
    """The drawn input values put two values an op must tell apart too close together."""


_margins = [False]
_exact_ties = [False]


@contextlib.contextmanager
def margins(nonfinite: bool = False) -> Iterator[None]:
    """Inside the block, :func:`apart` checks the values a numpy reference tells apart.

    ``nonfinite``: the inputs hold NaN, +-inf or -0.0 (:func:`harness.sprinkle`) and only forward
    values are compared. Then two values that are *exactly* equal (``inf == inf``, ``-0.0 == 0.0``,
    two sprinkled zeros) are no near kink: float32 and float64 decide them alike, and a tie must be
    broken as ``jnp`` breaks it (the first index), which is what the test is after. Near ties of
    finite values still are (rounding may decide them either way)."""
    _margins[0], _exact_ties[0] = True, nonfinite
    try:
        yield
    finally:
        _margins[0], _exact_ties[0] = False, False


def _checking(*values: Any) -> bool:
    return _margins[0] and R.xp_of(*values) is np


def _too_close(diff: np.ndarray, scale: float) -> bool:
    """Whether a finite entry of ``diff`` (a NaN or inf entry compares exactly) is under ``MARGIN * scale``;
    exact ties count only outside the non-finite mode (:func:`margins`)."""
    close = np.isfinite(diff) & (diff < MARGIN * scale)
    if _exact_ties[0]:
        close &= diff != 0
    return bool(np.any(close))


def _finite_scale(*arrays: Any) -> float:
    """``max(1, |finite entries|)``: the scale of the margin (an infinity decides exactly)."""
    return max([1.0] + [float(np.max(np.abs(a), initial=0, where=np.isfinite(a))) for a in map(np.asarray, arrays)])


def apart(a: Named, b: Named | float = 0.0) -> None:
    """Raise :class:`NearKink` if ``a`` and ``b`` (broadcast by name) come within ``MARGIN`` anywhere
    (where both are finite: NaN and +-inf compare exactly)."""
    if not _checking(a, b):
        return
    with np.errstate(invalid="ignore"):
        diff = np.abs((a - b).array) if isinstance(b, Named) else np.abs(a.array - b)
    scale = _finite_scale(a.array, b.array if isinstance(b, Named) else b)
    if _too_close(diff, scale):
        raise NearKink(f"values within {MARGIN:g} of each other at a kink")


def distinct_top(x: Named, dims: Sequence[str], k: int) -> None:
    """Raise :class:`NearKink` unless the ``k + 1`` largest values over ``dims`` (of each slice, in
    ``lax.top_k``'s order: NaN first) are ``MARGIN`` apart where both are finite."""
    if not _checking(x):
        return
    rest = [n for n in x.names if n not in dims]
    a = x.to([*rest, *dims]).array.reshape([x.sizes[n] for n in rest] + [-1])
    order = R._stable_descending(np, a)[..., : k + 1]
    top = np.take_along_axis(a, order, axis=-1)
    with np.errstate(invalid="ignore"):
        diff = top[..., :-1] - top[..., 1:]
    if top.shape[-1] > 1 and _too_close(diff, _finite_scale(a)):
        raise NearKink(f"near ties among the {k + 1} largest over {list(dims)}")


def distinct_bottom(x: Named, dims: Sequence[str]) -> None:
    distinct_top(-x, dims, 1)


# ---- the pieces of a program -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Input:
    """A fresh argument: ``kind`` normal, positive (in [0.5, 2]) or index (int32 in [low, high))."""

    dims: tuple[tuple[str, int], ...]
    kind: str = "normal"
    low: int = 0
    high: int = 0

    def make(self, rng: np.random.Generator) -> md.Tensor:
        shape = [s for _, s in self.dims]
        if self.kind == "index":
            a = rng.integers(self.low, self.high, shape).astype(np.int32)
        elif self.kind == "positive":
            a = rng.uniform(0.5, 2.0, shape).astype(np.float32)
        else:
            a = rng.standard_normal(shape).astype(np.float32)
        return harness.from_numpy(a, harness.dims(self.dims))

    def dummy(self) -> Named:
        shape = [s for _, s in self.dims]
        return Named(np.zeros(shape, np.int32) if self.kind == "index" else np.ones(shape), [n for n, _ in self.dims])


@dataclasses.dataclass
class Random:
    """A draw of ``jax.random.<kind>(jax.random.key(seed), sizes)`` the reference needs; the test fills
    ``value`` once per program (:func:`fill_randoms`), computed on one device."""

    kind: str
    seed: int
    dims: tuple[tuple[str, int], ...]
    minval: float = 0.0
    maxval: float = 1.0
    value: np.ndarray | None = None

    def named(self) -> Named:
        shape = [s for _, s in self.dims]
        return Named(np.zeros(shape, np.float32) if self.value is None else self.value, [n for n, _ in self.dims])

    def draw_jax(self) -> jax.Array:
        key = jax.random.key(self.seed)
        sizes = tuple(s for _, s in self.dims)
        if self.kind == "normal":
            return jax.random.normal(key, sizes)
        return jax.random.uniform(key, sizes, minval=self.minval, maxval=self.maxval)


@dataclasses.dataclass
class Step:
    """One op (or composite) of a chain: ``md(h, *fresh)`` and ``ref(h, *fresh)``, each returning the
    next value or a tuple ``(value, *side results)``."""

    name: str
    md: Callable[..., Any]
    ref: Callable[..., Any]
    fresh: tuple[Input, ...] = ()
    tied: bool | None = None
    """The result may hold ties: True; cannot: False; None: as the operand."""
    randoms: tuple[Random, ...] = ()
    family: str = ""

    def __repr__(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class Value:
    """What a builder knows of the value it extends: its dims (in order) and whether it may hold ties."""

    dims: dict[str, int]
    tied: bool = False


@dataclasses.dataclass
class Context:
    """What builders share within one program: the hypothesis draw, the mesh, the pool of dims, the
    layout's rules (grown as ops create dims)."""

    draw: Callable[..., Any]
    mesh: md.Mesh
    pool: dict[str, int]
    rules: dict[str, tuple[str, ...]]
    names: Iterator[int] = dataclasses.field(default_factory=itertools.count)

    def group(self, name: str) -> int:
        """Devices the dim ``name`` is split over."""
        return math.prod(self.mesh.axis_sizes[a] for a in self.rules.get(name, ()))

    def new_dim(self, size: int, like: str | None = None) -> str:
        """A fresh dim name of ``size``, with axes drawn for it (maybe those of the dim ``like``)."""
        name = f"n{next(self.names)}"
        taken = {a for axes in self.rules.values() for a in axes}
        axes = self.draw(S.dim_axes(self.mesh, size, taken, self.rules.get(like, ()) if like else ()))
        if axes:
            self.rules[name] = axes
        return name

    def some_dims(self, min_rank: int = 1, max_rank: int = MAX_RANK, exclude: Sequence[str] = ()) -> dict[str, int]:
        """Some pool dims (not in ``exclude``), in a drawn order; fewer than ``min_rank`` if the pool
        runs out or ``max_rank`` is lower."""
        names = [n for n in self.draw(st.permutations(list(self.pool))) if n not in exclude]
        top = max(0, min(max_rank, len(names)))
        k = self.draw(st.integers(min(min_rank, top), top))
        return {n: self.pool[n] for n in names[:k]}

    def subset(self, dims: dict[str, int], min_size: int = 0) -> dict[str, int]:
        """Some of ``dims``, in a drawn order."""
        names = self.draw(st.permutations(list(dims)))
        k = self.draw(st.integers(min(min_size, len(names)), len(names)))
        return {n: dims[n] for n in names[:k]}

    def one(self, options: Sequence[Any]) -> Any:
        return self.draw(st.sampled_from(list(options)))


def _dims(d: dict[str, int]) -> list[md.Dim]:
    return [md.Dim(n, s) for n, s in d.items()]


def _items(d: dict[str, int]) -> tuple[tuple[str, int], ...]:
    return tuple(d.items())


def _s(d: dict[str, int] | Sequence[str]) -> str:
    return " ".join(d)


def _permuted(ctx: Context, d: dict[str, int]) -> dict[str, int]:
    return {n: d[n] for n in ctx.draw(st.permutations(list(d)))}


def _union(*ds: dict[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in ds:
        out.update(d)
    return out


# ---- element-wise ------------------------------------------------------------------------------

UNARY = [
    # name, md, reference, effect on ties, kink (where the gradient or value jumps)
    ("tanh", md.tanh, R.tanh, None, None),
    ("sigmoid", md.sigmoid, R.sigmoid, None, None),
    ("gelu", md.gelu, R.gelu, None, None),
    ("softplus", md.softplus, R.softplus, None, None),
    ("log_sigmoid", md.log_sigmoid, R.log_sigmoid, None, None),
    ("negative", md.negative, R.negative, None, None),
    ("0.5 * h + 1", lambda h: h * 0.5 + 1.0, lambda h: h * 0.5 + 1.0, None, None),
    ("exp(h / 2)", lambda h: md.exp(h * 0.5), lambda h: R.exp(h * 0.5), None, None),
    (
        "log(softplus(h) + 0.5)",
        lambda h: md.log(md.softplus(h) + 0.5),
        lambda h: R.log(R.softplus(h) + 0.5),
        None,
        None,
    ),
    ("sqrt(h^2 + 0.25)", lambda h: md.sqrt(md.square(h) + 0.25), lambda h: R.sqrt(R.square(h) + 0.25), None, None),
    ("rsqrt(h^2 + 0.25)", lambda h: md.rsqrt(md.square(h) + 0.25), lambda h: R.rsqrt(R.square(h) + 0.25), None, None),
    (
        "power(softplus(h) + 0.5, 1.5)",
        lambda h: md.power(md.softplus(h) + 0.5, 1.5),
        lambda h: R.power(R.softplus(h) + 0.5, 1.5),
        None,
        None,
    ),
    ("square(h) / 2", lambda h: md.square(h) * 0.5, lambda h: R.square(h) * 0.5, None, None),
    (
        "h + stop_gradient(h) / 2",
        lambda h: h + md.stop_gradient(h) * 0.5,
        lambda h: h + R.stop_gradient(h) * 0.5,
        None,
        None,
    ),
    ("abs", md.abs, R.abs, None, 0.0),
    ("relu", md.relu, R.relu, True, 0.0),
    (
        "cast(h > 0, float32) * h",
        lambda h: md.cast(h > 0, jnp.float32) * h,
        # XLA makes cast(pred) * h a select (so -inf and NaN give 0 under jit, as md's compiled function)
        lambda h: R.where(R.greater(h, 0.0), h, 0.0),
        True,
        0.0,
    ),
]


def build_unary(ctx: Context, h: Value) -> Step:
    name, fn, ref, tied, kink = ctx.one(UNARY)
    if kink is None:
        return Step(name, fn, ref, tied=tied)

    def checked(x):
        apart(x, kink)
        return ref(x)

    return Step(name, fn, checked, tied=tied)


ARITHMETIC = {
    "add": (md.add, lambda a, b: a + b),
    "subtract": (md.subtract, lambda a, b: a - b),
    "multiply": (md.multiply, lambda a, b: a * b),
    "divide": (md.divide, lambda a, b: a / b),
    "maximum": (md.maximum, R.maximum),
    "minimum": (md.minimum, R.minimum),
    "power": (md.power, R.power),
}


def _operand(
    ctx: Context, h: Value, op: str
) -> tuple[str, Callable, Callable, tuple[Input, ...], bool, dict[str, int]] | None:
    """The other operand of a binary op: (label, md maker, reference maker, inputs, varies, dims).

    A fresh normal (or positive, for divide and power's base) input over drawn pool dims, or one
    made in the program: md.full / md.zeros / md.ones, md.range, a cast of int indices.
    ``varies``: its values are continuous random (a constant or small ints repeat).
    """
    kinds = ["fresh"] * 4 + (["full", "range", "cast"] if op in ("add", "subtract", "multiply") else [])
    kind = ctx.one(kinds)
    if kind == "range":
        dim = ctx.one(list(h.dims) or list(ctx.pool))
        size = h.dims.get(dim, ctx.pool.get(dim))
        d = md.Dim(dim, size)
        return (
            f"range({dim}) / 8",
            lambda: md.range(d, jnp.float32) * 0.125,
            lambda: R.arange(dim, size, np.float32) * 0.125,
            (),
            False,
            {dim: size},
        )
    dims = ctx.some_dims(1, exclude=())
    dims = {n: h.dims.get(n, s) for n, s in dims.items()}
    if len({*h.dims, *dims}) > MAX_RANK:
        return None
    if kind == "full":
        value = ctx.one([0.0, 1.0, -0.75])
        maker = {0.0: md.zeros, 1.0: md.ones}.get(value)
        make = (lambda: maker(_dims(dims))) if maker else (lambda: md.full(_dims(dims), value))
        sizes = tuple(dims.values())
        return (
            f"full[{_s(dims)}]={value}",
            make,
            lambda: Named(np.full(sizes, value, np.float32), list(dims)),
            (),
            False,
            dims,
        )
    if kind == "cast":
        idx = Input(_items(dims), "index", -3, 4)
        return (
            f"cast(i[{_s(dims)}], float32) / 4",
            lambda i: md.cast(i, jnp.float32) * 0.25,
            lambda i: R.cast(i, np.float32) * 0.25,
            (idx,),
            False,
            dims,
        )
    positive = op == "divide" or (op == "power")
    inp = Input(_items(dims), "positive" if positive else "normal")
    return (f"{'q' if positive else 'f'}[{_s(dims)}]", lambda f: f, lambda f: f, (inp,), True, dims)


def build_binary(ctx: Context, h: Value) -> Step | None:
    """add, subtract, multiply, divide, maximum, minimum, power with an operand broadcast by name, either side first."""
    op = ctx.one(list(ARITHMETIC))
    operand = _operand(ctx, h, op)
    if operand is None:
        return None
    label, make_md, make_ref, fresh, varies, dims = operand
    fn, ref = ARITHMETIC[op]
    first = ctx.draw(st.booleans()) and op not in ("divide", "power")
    n = len(fresh)
    if op == "power":  # a positive base to the power tanh(h): bounded
        md_fn = lambda h, *f: md.power(make_md(*f), md.tanh(h))  # noqa: E731
        ref_fn = lambda h, *f: R.power(make_ref(*f), R.tanh(h))  # noqa: E731
        name = f"power({label}, tanh(h))"
    elif first:
        md_fn = lambda h, *f: fn(make_md(*f), h)  # noqa: E731
        ref_fn = lambda h, *f: ref(make_ref(*f), h)  # noqa: E731
        name = f"{op}({label}, h)"
    else:
        md_fn = lambda h, *f: fn(h, make_md(*f))  # noqa: E731
        ref_fn = lambda h, *f: ref(h, make_ref(*f))  # noqa: E731
        name = f"{op}(h, {label})"
    if op in ("maximum", "minimum"):
        plain = ref_fn

        def ref_fn(h, *f):
            apart(h, make_ref(*f))
            return plain(h, *f)

    assert n == len(fresh)
    extra = set(dims) - set(h.dims)
    lacks = set(h.dims) - set(dims)
    if op in ("maximum", "minimum"):
        tied = True if (extra or lacks or not varies) else None
    elif not varies and extra:
        tied = True
    elif op in ("add", "subtract") and varies and not lacks:
        tied = False
    else:
        tied = None
    return Step(name, md_fn, ref_fn, fresh, tied=tied)


COMPARISONS = {
    ">": (md.greater, R.greater),
    "<": (md.less, R.less),
    ">=": (md.greater_equal, R.greater_equal),
    "<=": (md.less_equal, R.less_equal),
}


def build_select(ctx: Context, h: Value) -> Step | None:
    """A comparison (maybe combined with logical_and / or / not) and md.where; the condition is also a result."""
    dims = ctx.some_dims(1)
    dims = {n: h.dims.get(n, s) for n, s in dims.items()}
    if len({*h.dims, *dims}) > MAX_RANK:
        return None
    symbol = ctx.one(list(COMPARISONS))
    cmp_md, cmp_ref = COMPARISONS[symbol]
    logic = ctx.one(["", "and", "or", "not"])
    other = ctx.one(["h / 2", "f", "-h", "0"])
    f_in = Input(_items(dims))

    def cond_md(h, f):
        c = cmp_md(h, f)
        if logic == "and":
            return md.logical_and(c, h < 1.0)
        if logic == "or":
            return md.logical_or(c, md.greater(h, 1.0))
        return md.logical_not(c) if logic == "not" else c

    def cond_ref(h, f):
        apart(h, f)
        c = cmp_ref(h, f)
        if logic in ("and", "or"):
            apart(h, 1.0)
        if logic == "and":
            return R.logical_and(c, R.less(h, 1.0))
        if logic == "or":
            return R.logical_or(c, R.greater(h, 1.0))
        return R.logical_not(c) if logic == "not" else c

    def alt(h, f, m):
        return {"h / 2": h * 0.5, "f": f, "-h": -h if m is R else md.negative(h), "0": 0.0}[other]

    def md_fn(h, f):
        c = cond_md(h, f)
        return md.where(c, h, alt(h, f, md)), c

    def ref_fn(h, f):
        c = cond_ref(h, f)
        return R.where(c, h, alt(h, f, R)), c

    label = f"h {symbol} f[{_s(dims)}]"
    label = {"and": f"({label}) & (h < 1)", "or": f"({label}) | (h > 1)", "not": f"~({label})"}.get(logic, label)
    tied = None if (other == "f" and set(dims) == set(h.dims)) else True
    return Step(f"where({label}, h, {other}) (+ the condition)", md_fn, ref_fn, (f_in,), tied=tied)


# ---- reductions and the softmax family ---------------------------------------------------------

SUMS = {"reduce_sum": (md.reduce_sum, "sum"), "reduce_mean": (md.reduce_mean, "mean")}
EXTREMA = {"reduce_max": (md.reduce_max, "max"), "reduce_min": (md.reduce_min, "min")}


def build_reduction(ctx: Context, h: Value) -> Step | None:
    if not h.dims:
        return None
    ops = list(SUMS) + ([] if h.tied else list(EXTREMA))
    name = ctx.one(ops)
    fn, kind = {**SUMS, **EXTREMA}[name]
    every = ctx.draw(st.integers(0, 9)) == 0
    dims = list(h.dims) if every else list(ctx.subset(h.dims, 1))
    arg = None if every else dims

    def ref(x):
        if kind == "max":
            distinct_top(x, dims, 1)
        elif kind == "min":
            distinct_bottom(x, dims)
        return R.reduce(kind, x, dims)

    return Step(f"{name}({'all' if every else _s(dims)})", lambda x: fn(x, arg), ref)


SOFTMAX = {
    "softmax": (md.softmax, R.softmax),
    "log_softmax": (md.log_softmax, R.log_softmax),
    "logsumexp": (md.logsumexp, R.logsumexp),
}


def build_softmax(ctx: Context, h: Value) -> Step | None:
    if not h.dims:
        return None
    name = ctx.one(list(SOFTMAX))
    fn, ref = SOFTMAX[name]
    dims = list(ctx.subset(h.dims, 1))
    every = name == "logsumexp" and ctx.draw(st.integers(0, 4)) == 0
    arg = None if every else dims
    rows = {} if every else {n: s for n, s in h.dims.items() if n not in dims}
    if rows and ctx.draw(st.integers(0, 3)) == 0:
        return _masked_softmax(name, fn, ref, dims, rows)
    return Step(
        f"{name}({'all' if every else _s(dims)})", lambda x: fn(x, arg), lambda x: ref(x, None if every else dims)
    )


def _masked_softmax(
    name: str, fn: Callable[..., Any], ref: Callable[..., Any], dims: list[str], rows: dict[str, int]
) -> Step:
    """``name`` over ``dims`` with every third row (a position of the other dims) fully masked to
    -inf, as attention masks do (issue 21). logsumexp must give exactly -inf there, as jax.nn's
    (its -inf then reads 0, so the chain goes on finite); softmax and log_softmax give nan there,
    as jax.nn's, and the row reads 0. A gradient through the mask is finite on both sides."""
    mask = (np.arange(math.prod(rows.values())) % 3 == 1).reshape(tuple(rows.values()))
    inf = float("-inf")

    def md_fn(x):
        m = md.tensor(mask, [md.Dim(n, s) for n, s in rows.items()])
        y = fn(md.where(m, inf, x), dims)
        return md.where(md.equal(y, inf), 0.0, y) if name == "logsumexp" else md.where(m, 0.0, y)

    def ref_fn(x):
        m = Named(mask, list(rows))
        y = ref(R.where(m, inf, x), dims)
        return R.where(R.equal(y, inf), 0.0, y) if name == "logsumexp" else R.where(m, 0.0, y)

    return Step(f"{name}({_s(dims)}, masked rows)", md_fn, ref_fn, tied=True)


# ---- einsum ------------------------------------------------------------------------------------


def build_einsum(ctx: Context, h: Value) -> Step | None:
    """einsum of h with fresh weights (contracting some dims, keeping some, bringing new ones), scaled
    by 1/sqrt(terms summed); plain, plus a bias, a sum of two einsums (their pending partial sums
    added before any collective), or of three operands."""
    w = ctx.some_dims(1)
    w = {n: h.dims.get(n, s) for n, s in w.items()}
    union = _union(h.dims, w)
    out = [n for n in ctx.draw(st.permutations(list(union))) if ctx.draw(st.booleans())][:MAX_RANK]
    kind = ctx.one(["plain", "bias", "sum", "three"])
    w2 = ctx.some_dims(1) if kind == "three" else {}
    w2 = {n: union.get(n, s) for n, s in w2.items()}
    every = _union(union, w2)
    summed = math.prod(s for n, s in every.items() if n not in out)
    scale = 1.0 / math.sqrt(summed)
    out_dims = {n: every[n] for n in out}
    name = f"einsum(h, w[{_s(w)}]{f', v[{_s(w2)}]' if w2 else ''}, out=[{_s(out)}]) * {scale:.3g}"
    if kind == "plain":
        return Step(
            name,
            lambda h, a: md.einsum(h, a, out=out) * scale,
            lambda h, a: R.einsum(out, h, a) * scale,
            (Input(_items(w)),),
        )
    if kind == "three":
        return Step(
            name,
            lambda h, a, b: md.einsum(h, a, b, out=out) * scale,
            lambda h, a, b: R.einsum(out, h, a, b) * scale,
            (Input(_items(w)), Input(_items(w2))),
        )
    if kind == "bias":
        bias = ctx.subset(out_dims)
        return Step(
            f"{name} + b[{_s(bias)}]",
            lambda h, a, b: md.einsum(h, a, out=out) * scale + b,
            lambda h, a, b: R.einsum(out, h, a) * scale + b,
            (Input(_items(w)), Input(_items(bias))),
        )
    return Step(
        f"{name} + 0.5 * einsum(h, w2) * s",
        lambda h, a, b: md.einsum(h, a, out=out) * scale + 0.5 * md.einsum(h, b, out=out) * scale,
        lambda h, a, b: R.einsum(out, h, a) * scale + 0.5 * R.einsum(out, h, b) * scale,
        (Input(_items(w)), Input(_items(w))),
    )


# ---- reshapes ----------------------------------------------------------------------------------


def _factor_pairs(size: int) -> list[tuple[int, int]]:
    return S.factor_pairs(size)


def build_reshape(ctx: Context, h: Value) -> Step | None:
    """rename, transpose, a merge of two neighbours, a cut of one dim in two, replace_dimensions, rearrange."""
    names, sizes = list(h.dims), h.dims
    kinds = ["rename"] + (["transpose", "merge", "replace"] if len(names) >= 2 else [])
    cuttable = [n for n in names if _factor_pairs(sizes[n])]
    if cuttable and len(names) < MAX_RANK:
        kinds.append("cut")
    if cuttable and len(names) >= 2:
        kinds.append("rearrange")
    if not names:
        return None
    kind = ctx.one(kinds)
    if kind == "rename":
        old = ctx.one(names)
        new = ctx.new_dim(sizes[old], like=old)
        return Step(f"rename({old} -> {new})", lambda t: md.rename(t, old, new), lambda t: R.rename(t, old, new))
    if kind == "transpose":
        perm = ctx.draw(st.permutations(names))
        form = ctx.one(["names", "string", "dims"])
        arg = {"names": list(perm), "string": " ".join(perm), "dims": [md.Dim(n, sizes[n]) for n in perm]}[form]
        return Step(f"transpose({_s(perm)})", lambda t: md.transpose(t, arg), lambda t: t.to(perm))
    if kind in ("merge", "replace"):
        i = ctx.draw(st.integers(0, len(names) - 2))
        total = sizes[names[i]] * sizes[names[i + 1]]
        before, after = list(sizes.items())[:i], list(sizes.items())[i + 2 :]
        if kind == "merge":
            m = ctx.new_dim(total, like=names[i])
            new = [*before, (m, total), *after]
            return Step(
                f"reshape({names[i]} {names[i + 1]} -> {m})",
                lambda t: md.reshape(t, [md.Dim(n, s) for n, s in new]),
                lambda t: R.reshape(t, new),
            )
        c1, c2 = ctx.one(_factor_pairs(total))
        a, b = ctx.new_dim(c1, like=names[i]), ctx.new_dim(c2, like=names[i + 1])
        new = [*before, (a, c1), (b, c2), *after]
        old = names[i : i + 2]
        return Step(
            f"replace_dimensions({_s(old)} -> {a}={c1} {b}={c2})",
            lambda t: md.replace_dimensions(t, old, [md.Dim(a, c1), md.Dim(b, c2)]),
            lambda t: R.reshape(t, new),
        )
    cut = ctx.one(cuttable)
    hi, lo = ctx.one(_factor_pairs(sizes[cut]))
    a, b = ctx.new_dim(hi, like=cut), ctx.new_dim(lo)
    atoms = [d for n, s in sizes.items() for d in ([(a, hi), (b, lo)] if n == cut else [(n, s)])]
    if kind == "cut":
        return Step(
            f"reshape({cut} -> {a}={hi} {b}={lo})",
            lambda t: md.reshape(t, [md.Dim(n, s) for n, s in atoms]),
            lambda t: R.reshape(t, atoms),
        )
    # rearrange: cut, reorder every atom, merge two neighbours.
    order = ctx.draw(st.permutations([n for n, _ in atoms]))
    k = ctx.draw(st.integers(0, len(order) - 2))
    atom = dict(atoms)
    g = ctx.new_dim(atom[order[k]] * atom[order[k + 1]], like=order[k])
    out = (
        [(n, atom[n]) for n in order[:k]]
        + [(g, atom[order[k]] * atom[order[k + 1]])]
        + [(n, atom[n]) for n in order[k + 2 :]]
    )
    left = " ".join(f"({a} {b})" if n == cut else n for n in names)
    right = " ".join([*order[:k], f"({g}: {order[k]} {order[k + 1]})", *order[k + 2 :]])
    pattern = f"{left} -> {right}"
    return Step(
        f"rearrange('{pattern}', {a}={hi})",
        lambda t: md.rearrange(t, pattern, **{a: hi}),
        lambda t: R.reshape(R.reshape(t, atoms).to(order), out),
    )


# ---- cuts and joins ----------------------------------------------------------------------------


def build_cut(ctx: Context, h: Value) -> Step | None:
    """concat, split, slice, pad, stack, unstack (then stacked back reversed) along a dim of h; sizes
    stay multiples of the dim's split, offsets need not."""
    if not h.dims:
        return None
    dim = ctx.one(list(h.dims))
    n, g = h.dims[dim], ctx.group(dim)
    blocks = n // g
    kinds = ["concat", "slice", "pad"] + (["split"] if blocks >= 2 else []) + (["unstack"] if n <= 4 else [])
    if len(h.dims) < MAX_RANK:
        kinds.append("stack")
    kind = ctx.one(kinds)
    if kind == "concat":
        parts = ctx.draw(st.integers(1, 2))
        others = []
        for _ in range(parts):  # the joined dim anywhere; the others in h's order, as concat wants
            m = g * ctx.draw(st.integers(1, 2))
            items = [(k, v) for k, v in h.dims.items() if k != dim]
            items.insert(ctx.draw(st.integers(0, len(items))), (dim, m))
            others.append(dict(items))
        at = ctx.draw(st.integers(0, parts))
        fresh = tuple(Input(_items(o)) for o in others)

        def order(h, fs):
            xs = list(fs)
            xs.insert(at, h)
            return xs

        return Step(
            f"concat(h at {at} with f[{'; '.join(_s(o) + f' {dim}={o[dim]}' for o in others)}], {dim})",
            lambda h, *fs: md.concat(order(h, fs), dim),
            lambda h, *fs: R.concat(order(h, fs), dim),
            fresh,
        )
    if kind == "slice":
        size = g * ctx.draw(st.integers(1, blocks))
        begin = ctx.draw(st.integers(0, n - size))
        return Step(
            f"slice({dim}, {begin}, {size})",
            lambda t: md.slice(t, begin, size, dim),
            lambda t: R.slice_(t, begin, size, dim),
        )
    if kind == "pad":
        added = g * ctx.draw(st.integers(1, 2))
        before = ctx.draw(st.integers(0, added))
        value = ctx.one([0.0, 1.5])
        return Step(
            f"pad({dim}, [{before}, {added - before}], {value})",
            lambda t: md.pad(t, [before, added - before], dim, value=value),
            lambda t: R.pad(t, before, added - before, dim, value),
            tied=True,
        )
    if kind == "split":
        equal = ctx.draw(st.booleans())
        if equal:
            parts = ctx.one([p for p in range(2, blocks + 1) if blocks % p == 0])
            arg: Any = parts
            sizes = [n // parts] * parts
        else:
            k = ctx.draw(st.integers(2, min(blocks, 3)))
            cuts = sorted(ctx.draw(st.lists(st.integers(1, blocks - 1), min_size=k - 1, max_size=k - 1, unique=True)))
            bounds = [0, *cuts, blocks]
            sizes = [(b - a) * g for a, b in zip(bounds, bounds[1:])]
            arg = sizes
        keep = ctx.draw(st.integers(0, len(sizes) - 1))

        def pick(parts):
            return (parts[keep], *(p for i, p in enumerate(parts) if i != keep))

        return Step(
            f"split({dim}, {arg}) -> part {keep} (+ the others)",
            lambda t: pick(md.split(t, dim, arg)),
            lambda t: pick(R.split(t, dim, arg)),
        )
    if kind == "stack":
        new = ctx.new_dim(2)
        axis = ctx.draw(st.integers(0, len(h.dims)))
        return Step(
            f"stack([h, f], {new}, axis={axis})",
            lambda h, f: md.stack([h, f], new, axis=axis),
            lambda h, f: R.stack([h, f], new, axis),
            (Input(_items(h.dims)),),
        )
    position = list(h.dims).index(dim)
    return Step(
        f"stack(unstack(h, {dim}) reversed, {dim})",
        lambda t: md.stack(md.unstack(t, dim)[::-1], dim, axis=position),
        lambda t: R.stack(R.unstack(t, dim)[::-1], dim, position),
    )


# ---- index ops ---------------------------------------------------------------------------------


def build_gather(ctx: Context, h: Value) -> Step | None:
    """gather from h at fresh indices (out of range: zeros) or from a fresh table at argmax(h); take_along
    at fresh indices or at argmax(h) (the max, by index); one_hot of fresh indices or of argmax(h)."""
    if not h.dims:
        return None
    dim = ctx.one(list(h.dims))
    n = h.dims[dim]
    rest = {k: v for k, v in h.dims.items() if k != dim}
    kinds = ["gather", "take_along", "one_hot"] + (
        [] if h.tied else ["gather argmax", "take_along argmax", "one_hot argmax"]
    )
    kind = ctx.one(kinds)
    if kind == "gather":
        idx = ctx.some_dims(1, MAX_RANK - len(rest), exclude=list(h.dims))  # never named like dim: a ShapeError
        if not idx or len(idx) + len(rest) > MAX_RANK:
            return None
        i = Input(_items(idx), "index", -2, n + 2)
        return Step(
            f"gather(h, i[{_s(idx)}], {dim})",
            lambda h, i: md.gather(h, i, dim),
            lambda h, i: R.gather(h, i, dim),
            (i,),
            tied=True,
        )
    if kind == "take_along":
        idx = ctx.subset(rest)
        i = Input(_items(idx), "index", -1, n + 1)
        return Step(
            f"take_along(h, i[{_s(idx)}], {dim})",
            lambda h, i: md.take_along(h, i, dim),
            lambda h, i: R.take_along(h, i, dim),
            (i,),
            tied=True,
        )
    if kind == "one_hot":
        idx = ctx.subset(rest)
        i = Input(_items(idx), "index", -1, n + 1)
        d = md.Dim(dim, n)
        return Step(
            f"h * one_hot(i[{_s(idx)}], {dim}, on=2, off=0.5)",
            lambda h, i: h * md.one_hot(i, d, on_value=2.0, off_value=0.5),
            lambda h, i: h * R.one_hot(i, dim, n, 2.0, 0.5),
            (i,),
        )

    def top(x):
        distinct_top(x, [dim], 1)
        return R.argmax(x, dim)

    if kind == "take_along argmax":
        return Step(
            f"take_along(h, argmax(h, {dim}), {dim})",
            lambda h: md.take_along(h, md.argmax(h, dim), dim),
            lambda h: R.take_along(h, top(h), dim),
        )
    if kind == "one_hot argmax":
        new = ctx.new_dim(n, like=dim)
        d = md.Dim(new, n)
        return Step(
            f"one_hot(argmax(h, {dim}), {new}) * reduce_max(h, {dim})",
            lambda h: md.one_hot(md.argmax(h, dim), d) * md.reduce_max(h, dim),
            lambda h: R.one_hot(top(h), new, n) * R.reduce("max", h, [dim]),
            tied=True,
        )
    if len(rest) >= MAX_RANK:
        return None
    table = ctx.new_dim(n)
    extra = ctx.some_dims(0, MAX_RANK - len(rest) - 0, exclude=list(h.dims))
    extra = dict(list(extra.items())[: MAX_RANK - len(rest)])
    w = _permuted(ctx, {table: n, **extra})
    return Step(
        f"gather(w[{_s(w)}], argmax(h, {dim}), {table})",
        lambda h, w: md.gather(w, md.argmax(h, dim), table),
        lambda h, w: R.gather(w, top(h), table),
        (Input(_items(w)),),
        tied=True,
    )


def build_top_k(ctx: Context, h: Value) -> Step | None:
    """top_k (values go on; indices are a result) or argmax (a result; h goes on unchanged)."""
    if not h.dims or h.tied:
        return None
    dim = ctx.one(list(h.dims))
    n = h.dims[dim]
    if ctx.draw(st.booleans()):
        k = ctx.draw(st.integers(1, min(n, 5)))
        kd = ctx.new_dim(k)

        def ref(x):
            distinct_top(x, [dim], k)
            return R.top_k(x, dim, kd, k)

        return Step(f"top_k(h, {dim}, {kd}={k}) (+ indices)", lambda x: md.top_k(x, dim, md.Dim(kd, k)), ref)

    def ref(x):
        distinct_top(x, [dim], 1)
        return x, R.argmax(x, dim)

    return Step(f"h (+ argmax(h, {dim}))", lambda x: (x, md.argmax(x, dim)), ref)


def build_cumsum_shift(ctx: Context, h: Value) -> Step | None:
    if not h.dims:
        return None
    dim = ctx.one(list(h.dims))
    if ctx.draw(st.booleans()):
        exclusive = ctx.draw(st.booleans())
        return Step(
            f"cumsum(h, {dim}, exclusive={exclusive})",
            lambda t: md.cumsum(t, dim, exclusive=exclusive),
            lambda t: R.cumsum(t, dim, exclusive),
            tied=True if exclusive else None,
        )
    n = h.dims[dim]
    block = max(n // ctx.group(dim), 1)
    offset = ctx.one(
        sorted({0, 1, block - 1, block, block + 1, 2 * block, -1, -block, -block - 1, n - 1, n, n + 3, -n})
    )
    wrap = ctx.draw(st.booleans())
    return Step(
        f"shift(h, {offset}, {dim}, wrap={wrap})",
        lambda t: md.shift(t, offset, dim, wrap=wrap),
        lambda t: R.shift(t, offset, dim, wrap),
        tied=None if wrap else True,
    )


# ---- random ------------------------------------------------------------------------------------


def build_random(ctx: Context, h: Value) -> Step | None:
    """h + normal(key, dims) / 2, h * uniform(key, dims, 0.5, 1.5), or dropout(key, h, rate, noise dims):
    the reference draws with jax.random on global arrays."""
    seed = ctx.draw(st.integers(0, 2**31 - 1))
    key = jax.random.key(seed)
    kind = ctx.one(["normal", "uniform", "dropout"] if h.dims else ["normal", "uniform"])
    if kind == "dropout":
        rate = ctx.one([0.1, 0.5])
        noise = ctx.subset(h.dims, 1) if ctx.draw(st.booleans()) else dict(h.dims)
        r = Random("uniform", seed, _items(noise))
        shape = _dims(noise)
        return Step(
            f"dropout(key {seed}, h, {rate}, [{_s(noise)}])",
            lambda t: md.dropout(key, t, rate, shape),
            lambda t: R.where(R.greater_equal(r.named(), rate), t / (1.0 - rate), 0.0).to(t.names),  # a dropped inf: 0
            randoms=(r,),
            tied=True,
        )
    dims = ctx.subset(h.dims, 1) if h.dims and ctx.draw(st.booleans()) else ctx.some_dims(1)
    dims = {n: h.dims.get(n, s) for n, s in dims.items()}
    if len({*h.dims, *dims}) > MAX_RANK:
        return None
    shape = _dims(dims)
    if kind == "normal":
        r = Random("normal", seed, _items(dims))
        return Step(
            f"h + normal(key {seed}, [{_s(dims)}]) / 2",
            lambda t: t + md.random.normal(key, shape) * 0.5,
            lambda t: t + r.named() * 0.5,
            randoms=(r,),
            tied=False if set(h.dims) <= set(dims) else None,
        )
    r = Random("uniform", seed, _items(dims), 0.5, 1.5)
    return Step(
        f"h * uniform(key {seed}, [{_s(dims)}], 0.5, 1.5)",
        lambda t: t * md.random.uniform(key, shape, minval=0.5, maxval=1.5),
        lambda t: t * r.named(),
        randoms=(r,),
    )


def fill_randoms(randoms: Sequence[Random]) -> None:
    """Every draw's reference value, from one jitted program on one device."""
    if not randoms:
        return
    program = jax.jit(lambda: [r.draw_jax() for r in randoms])
    values = harness.compile_fast(program.lower())()
    for r, v in zip(randoms, values):
        r.value = np.asarray(v)


# ---- conv2d ------------------------------------------------------------------------------------


def build_conv(ctx: Context, h: Value) -> Step | None:
    """conv2d over three dims of h (broadcast first with a fresh input to rank 3 if needed) with a fresh
    kernel of odd sizes 1, 3 or 5; the result scaled by 1/sqrt(terms summed)."""
    missing = MAX_RANK - len(h.dims)
    pad_dims = ctx.some_dims(missing, missing, exclude=list(h.dims)) if missing else {}
    x = _union(h.dims, pad_dims)
    if len(x) != 3:
        return None
    height, width, channels = ctx.draw(st.permutations(list(x)))
    if ctx.rules.get(height) or ctx.rules.get(width):
        # Open defect (docs/design.md, "Testing"): in one packed CI program (seed 29349) gspmd's
        # kernel gradient of a conv2d with a split height came out 4x (the unused data axis);
        # not reproduced alone. Split windowed dims are drawn by test_convnet's tests instead.
        return None
    kh_size, kw_size = ctx.one([1, 3, 5]), ctx.one([1, 3, 5])
    out_size = ctx.one([2, 4, 6])
    kh, kw, out = ctx.new_dim(kh_size), ctx.new_dim(kw_size), ctx.new_dim(out_size)
    kernel = _permuted(ctx, {kh: kh_size, kw: kw_size, channels: x[channels], out: out_size})
    scale = 1.0 / math.sqrt(kh_size * kw_size * x[channels])
    names = dict(height=height, width=width, in_dim=channels, out_dim=out, kernel_height=kh, kernel_width=kw)
    fresh = (Input(_items(pad_dims)),) if pad_dims else ()

    def md_fn(h, k, *p):
        return md.conv2d(h * p[0] if p else h, k, **names) * scale

    def ref_fn(h, k, *p):
        return R.conv2d(h * p[0] if p else h, k, height, width, channels, out, kh, kw) * scale

    padded = "h * f[" + _s(pad_dims) + "]" if pad_dims else "h"
    label = f"conv2d({padded}, k[{_s(kernel)}], height={height}, width={width}, in={channels}, out={out}) * {scale:.3g}"
    return Step(label, md_fn, ref_fn, (Input(_items(kernel)), *fresh))


# ---- composites: md.scan, jax.checkpoint ---------------------------------------------------------


def run(steps: Sequence[Step], which: str, h: Any, fresh: Sequence[Any]) -> tuple:
    """``(value, *side results)`` of ``steps`` (their ``md`` or ``ref`` functions) applied to ``h``."""
    sides: list[Any] = []
    i = 0
    for step in steps:
        n = len(step.fresh)
        result = (step.md if which == "md" else step.ref)(h, *fresh[i : i + n])
        i += n
        if isinstance(result, tuple):
            h, *more = result
            sides += more
        else:
            h = result
    return (h, *sides)


def after(step: Step, value: Value) -> Value:
    """The value ``step`` makes of ``value``: dims from its reference on placeholder inputs."""
    h = Named(np.ones(list(value.dims.values())), list(value.dims))
    result = step.ref(h, *(f.dummy() for f in step.fresh))
    out = result[0] if isinstance(result, tuple) else result
    return Value(out.sizes, value.tied if step.tied is None else step.tied)


def draw_steps(ctx: Context, value: Value, count: int, families: Sequence[str]) -> tuple[list[Step], Value]:
    """``count`` steps from the ``families``, each drawn until one applies to the value it extends."""
    steps = []
    for _ in range(count):
        step = None
        while step is None:
            family = ctx.one(families)
            step = FAMILIES[family](ctx, value)
        step.family = family
        steps.append(step)
        value = after(step, value)
    return steps, value


def _composite(
    name: str, md_fn: Callable, ref_fn: Callable, fresh: Sequence[Input], subs: Sequence[Step], tied: bool
) -> Step:
    return Step(
        name,
        md_fn,
        ref_fn,
        tuple(fresh),
        tied=tied,
        randoms=tuple(r for s in subs for r in s.randoms),
    )


SCAN_BODY = ("unary", "binary", "select", "reduction", "softmax", "einsum", "random")
"""Families inside a scan body: those that keep every dim's size (the carry keeps its dims)."""


def build_scan(ctx: Context, h: Value) -> Step | None:
    """md.scan over a dim of h (carry: md.zeros, md.full, a mean of h, or a fresh input), or over a
    fresh input's new dim (carry: h). The body: ``u = x / 2 + c`` (or ``c + x / 2``), drawn steps on
    u, then ``t = tanh(mean of u over the dims c lacks)`` and ``c' = c / 2 + t``; the result is
    ``(ys = t stacked, carry)`` or the carry alone."""
    over_h = bool(h.dims) and ctx.draw(st.booleans())
    fresh: list[Input] = []
    if over_h:
        s = ctx.one(list(h.dims))
        length = h.dims[s]
        x_dims = {k: v for k, v in h.dims.items() if k != s}
        c_dims = ctx.subset(x_dims)
        init = ctx.one(["mean", "fresh", "zeros", "full"])
        if init == "fresh":
            fresh.append(Input(_items(c_dims)))
        u_dims = x_dims
    else:
        length = ctx.one([2, 3, 4])
        s = ctx.new_dim(length)
        x_dims = ctx.subset(h.dims, 0 if h.dims else 0)
        x_dims = dict(list(x_dims.items())[: MAX_RANK - 1])
        c_dims = dict(h.dims)
        init = ctx.one(["h", "tanh(h)"])
        fresh.append(Input(_items(_permuted(ctx, {s: length, **x_dims}))))
        u_dims = c_dims
    sub, _ = draw_steps(ctx, Value(u_dims, h.tied), 1, SCAN_BODY)
    remat = ctx.draw(st.booleans())
    emit = ctx.draw(st.booleans())
    own = len(fresh)
    fresh += [f for step in sub for f in step.fresh]
    value = 0.375

    def start(m, h, f):
        if init == "zeros":
            return md.zeros(_dims(c_dims)) if m is md else Named(np.zeros(list(c_dims.values())), list(c_dims))
        if init == "full":
            return (
                md.full(_dims(c_dims), value) if m is md else Named(np.full(list(c_dims.values()), value), list(c_dims))
            )
        if init == "mean":
            gone = [n for n in h.names if n not in c_dims]
            return (md.reduce_mean(h, gone) if m is md else R.reduce("mean", h, gone)) if gone else h
        if init == "fresh":
            return f[0]
        return h if init == "h" else (md.tanh(h) if m is md else R.tanh(h))

    def step_fn(m, c, x, f):
        u = x * 0.5 + c if over_h else c + x * 0.5
        u2 = run(sub, "md" if m is md else "ref", u, f[own:])[0]
        extra = [n for n in u2.names if n not in c.names]
        red = (md.reduce_mean(u2, extra) if m is md else R.reduce("mean", u2, extra)) if extra else u2
        t = md.tanh(red) if m is md else R.tanh(red)
        return c * 0.5 + t, t

    def md_fn(h, *f):
        xs = h if over_h else f[0]
        carry, ys = md.scan(
            lambda c, x: (lambda r: (r[0], r[1] if emit else None))(step_fn(md, c, x, f)),
            start(md, h, f),
            xs,
            s,
            remat=remat,
        )
        return (ys, carry) if emit else carry

    def ref_fn(h, *f):
        xs = h if over_h else f[0]
        c, ts = start(R, h, f), []
        for x in R.unstack(xs, s):
            c, t = step_fn(R, c, x, f)
            ts.append(t)
        return (R.stack(ts, s, 0), c) if emit else c

    body = " -> ".join(map(repr, sub))
    source = f"h over {s}" if over_h else f"xs[{_s(fresh[0].dims and dict(fresh[0].dims))}] over {s}"
    returns = " -> (ys, carry)" if emit else " -> carry"
    name = f"scan({source}, carry[{_s(c_dims)}]={init}, body: u -> {body}, remat={remat}){returns}"
    return _composite(name, md_fn, ref_fn, fresh, sub, tied=h.tied)


POLICIES = {
    "default": None,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def build_checkpoint(ctx: Context, h: Value) -> Step | None:
    """A user's ``jax.checkpoint`` (prevent_cse either way, a policy) around 1-2 drawn steps."""
    sub, value = draw_steps(ctx, h, ctx.draw(st.integers(1, 2)), CHECKPOINT_BODY)
    prevent_cse = ctx.draw(st.booleans())
    policy = ctx.one(list(POLICIES))
    fresh = [f for step in sub for f in step.fresh]
    md_fn = jax.checkpoint(lambda h, *f: run(sub, "md", h, f), prevent_cse=prevent_cse, policy=POLICIES[policy])
    name = f"checkpoint({' -> '.join(map(repr, sub))}, prevent_cse={prevent_cse}, policy={policy})"
    return _composite(name, md_fn, lambda h, *f: run(sub, "ref", h, f), fresh, sub, tied=value.tied)


FAMILIES: dict[str, Callable[[Context, Value], Step | None]] = {
    "unary": build_unary,
    "binary": build_binary,
    "select": build_select,
    "reduction": build_reduction,
    "softmax": build_softmax,
    "einsum": build_einsum,
    "reshape": build_reshape,
    "cut": build_cut,
    "gather": build_gather,
    "top_k": build_top_k,
    "cumsum_shift": build_cumsum_shift,
    "random": build_random,
    "conv2d": build_conv,
    "scan": build_scan,
    "checkpoint": build_checkpoint,
}
"""Every op family: element-wise (unary, binary, select: comparisons, logic, where, cast),
reductions, the softmax family, einsum, reshapes, cuts and joins, gather / take_along / one_hot,
top_k / argmax, cumsum / shift, random, conv2d, md.scan, jax.checkpoint."""

CHECKPOINT_BODY = tuple(f for f in FAMILIES if f not in ("scan", "checkpoint"))


# ---- chains and programs -----------------------------------------------------------------------


@dataclasses.dataclass
class Chain:
    start: Input
    steps: list[Step]

    @property
    def inputs(self) -> list[Input]:
        return [self.start, *(f for s in self.steps for f in s.fresh)]

    def run(self, which: str, x: Any, *fresh: Any) -> tuple:
        return run(self.steps, which, x, fresh)

    def __repr__(self) -> str:
        return f"x[{_s(dict(self.start.dims))}] -> " + " -> ".join(map(repr, self.steps))

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # how hypothesis prints a drawn chain
        p.text(repr(self))


@st.composite
def chains(draw, ctx: Context, min_len: int = 2, max_len: int = 3) -> Chain:
    """A chain from a fresh input of 1-3 pool dims; ``ctx``'s rules grow with the dims it creates."""
    ctx = dataclasses.replace(ctx, draw=draw)
    start = ctx.some_dims(1)
    steps, _ = draw_steps(ctx, Value(start), draw(st.integers(min_len, max_len)), list(FAMILIES))
    return Chain(Input(_items(start)), steps)


@st.composite
def pool_rules(draw, mesh: md.Mesh, pool: dict[str, int]) -> dict[str, tuple[str, ...]]:
    """Split for each pool dim (in a drawn order, so that no dim always chooses first)."""
    rules: dict[str, tuple[str, ...]] = {}
    for name in draw(st.permutations(list(pool))):
        axes = draw(S.dim_axes(mesh, pool[name], {a for v in rules.values() for a in v}))
        if axes:
            rules[name] = axes
    return rules


@dataclasses.dataclass
class Program:
    """Chains compiled together: ``md_fn(*args)`` and ``ref_fn(*args)`` return one tuple per chain."""

    chains: list[Chain]

    @property
    def inputs(self) -> list[Input]:
        return [i for c in self.chains for i in c.inputs]

    def _spans(self) -> list[slice]:
        starts = np.cumsum([0, *(len(c.inputs) for c in self.chains)])
        return [slice(int(a), int(b)) for a, b in zip(starts, starts[1:])]

    def md_fn(self, *args: md.Tensor) -> tuple:
        return tuple(c.run("md", *args[s]) for c, s in zip(self.chains, self._spans()))

    def ref_fn(self, *args: Named) -> tuple:
        return tuple(c.run("ref", *args[s]) for c, s in zip(self.chains, self._spans()))

    def randoms(self) -> list[Random]:
        return [r for c in self.chains for s in c.steps for r in s.randoms]

    def make_inputs(self, rng: np.random.Generator) -> list[md.Tensor]:
        return [i.make(rng) for i in self.inputs]

    def shapes(self) -> list[dict[str, int]]:
        """Every tensor the reference makes (inputs, intermediates, results), from placeholder inputs."""
        with R.recording() as made:
            self.ref_fn(*(i.dummy() for i in self.inputs))
        return [dict(i.dims) for i in self.inputs] + [x.sizes for x in made]


def legal_layout(rules: dict[str, tuple[str, ...]], mesh: md.Mesh, shapes: Sequence[dict[str, int]]) -> md.Layout:
    """``rules`` less the rule of the later dim of every pair that shares an axis and meets in one of
    ``shapes`` (and of any dim whose size its axes do not divide), until none is left."""
    rules = dict(rules)
    while (bad := _first_illegal(rules, mesh, shapes)) is not None:
        del rules[bad]
    return md.Layout(rules)


def _first_illegal(rules, mesh, shapes) -> str | None:
    for shape in shapes:
        owner: set[str] = set()
        for name, size in shape.items():
            axes = rules.get(name, ())
            if size % math.prod(mesh.axis_sizes[a] for a in axes) or owner & set(axes):
                return name
            owner.update(axes)
    return None
