"""Short random chains of ops, on drawn meshes, dim sizes and layouts, against numpy.

A chain starts from one input and applies 2 to 4 ops drawn from :data:`OPS`; some ops bring
fresh inputs (the other operand of an add, the weight of an einsum). Ops meet each other's
layouts here: an einsum's pending partial sums flow into an add, a reduction, a softmax; a
broadcast puts a replicated tensor next to a split one. Each example compiles
:data:`CHAINS_PER_EXAMPLE` independent chains in one program under one layout (compiles are
the cost; the chains share nothing else) and runs the full harness check on it: values on both
backends, gradients of every input, shardings, and md.explain against the compiled HLO.

Adding an op family: write a builder ``build(draw, h, pool) -> Step | None`` and append
``(name, build)`` to :data:`OPS`. ``h`` is the current value's dims (``{name: size}``, in
order), ``pool`` every dim name the example may use (the layout has rules for these). The
builder draws its parameters with ``draw`` and returns a :class:`Step`: the md op, its
reference (written with :mod:`reference`), and the fresh inputs it takes; or None when it does
not apply to ``h`` (the chain then draws another op). Keep results at rank <= 3, and do not
make ties that a later reduce_max/min would differentiate (a value repeated along a dim, as
``maximum(h, f)`` does when ``f`` lacks some of ``h``'s dims): with ties split across shards the
spmd gradient differs from jnp's (a known bug, see test_reduction.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
from hypothesis import assume, given, settings, strategies as st

import harness
import meshdsl as md
import reference as R
import strategies as S
from reference import Named

CHAINS_PER_EXAMPLE = 3
MAX_RANK = 3


@dataclasses.dataclass
class Step:
    """One op of a chain: ``md_fn(h, *fresh)`` and its reference ``ref_fn(h, *fresh)``."""

    name: str
    md_fn: Callable[..., md.Tensor]
    ref_fn: Callable[..., Named]
    fresh: tuple[tuple[dict[str, int], str], ...] = ()
    """Fresh inputs: (dims, kind), kind as for :func:`harness.rand` (normal, positive)."""

    def __repr__(self) -> str:
        return self.name


def _names(d: dict[str, int]) -> str:
    return " ".join(d)


def _draw_dims(draw, pool: dict[str, int], min_rank: int = 0) -> dict[str, int]:
    """Some dims of ``pool`` (at least ``min_rank``), in a drawn order."""
    names = draw(st.permutations(list(pool)))
    chosen = [n for n in names if draw(st.booleans())]
    while len(chosen) < min_rank:
        chosen.append(next(n for n in names if n not in chosen))
    return {n: pool[n] for n in chosen}


def _permuted(draw, dims: dict[str, int]) -> dict[str, int]:
    """The same dims in a drawn order."""
    return {n: dims[n] for n in draw(st.permutations(list(dims)))}


# ---- builders ----------------------------------------------------------------------------------

UNARY = [
    ("tanh", md.tanh, R.tanh),
    ("sigmoid", md.sigmoid, R.sigmoid),
    ("gelu", md.gelu, R.gelu),
    ("negative", md.negative, R.negative),
    ("scale", lambda h: h * 0.5 + 1.0, lambda h: h * 0.5 + 1.0),
]


def build_unary(draw, h, pool):
    name, fn, ref = draw(st.sampled_from(UNARY))
    return Step(name, fn, ref)


BINARY = [
    ("add", md.add, lambda a, b: a + b),
    ("subtract", md.subtract, lambda a, b: a - b),
    ("multiply", md.multiply, lambda a, b: a * b),
]


def build_binary(draw, h, pool):
    """An op with a fresh operand drawn from the pool: broadcasting by name both ways."""
    name, fn, ref = draw(st.sampled_from(BINARY))
    other = _draw_dims(draw, pool, min_rank=1)
    if len({*h, *other}) > MAX_RANK:
        return None
    reverse = draw(st.booleans())
    if reverse:  # fresh operand first: the result's dims start with the fresh tensor's
        return Step(f"{name}(f[{_names(other)}], h)", lambda h, f: fn(f, h), lambda h, f: ref(f, h), ((other, "normal"),))
    return Step(f"{name}(h, f[{_names(other)}])", fn, ref, ((other, "normal"),))


def build_divide(draw, h, pool):
    other = _draw_dims(draw, pool, min_rank=1)
    if len({*h, *other}) > MAX_RANK:
        return None
    return Step(f"divide(h, q[{_names(other)}])", md.divide, lambda a, b: a / b, ((other, "positive"),))


def build_extremum(draw, h, pool):
    """maximum/minimum/where with an operand of h's own dims: no broadcasting, so no ties for a later reduce_max."""
    if not h:
        return None
    other = _permuted(draw, h)
    kind = draw(st.sampled_from(["maximum", "minimum", "where"]))
    if kind == "maximum":
        return Step(f"maximum(h, f[{_names(other)}])", md.maximum, R.maximum, ((other, "normal"),))
    if kind == "minimum":
        return Step(f"minimum(h, f[{_names(other)}])", md.minimum, R.minimum, ((other, "normal"),))
    return Step(
        f"where(h > f[{_names(other)}], h, f)",
        lambda h, f: md.where(h > f, h, f),
        lambda h, f: R.where(R.greater(h, f), h, f),
        ((other, "normal"),),
    )


REDUCTIONS = [
    ("reduce_sum", md.reduce_sum, lambda x, d: R.reduce("sum", x, d)),
    ("reduce_mean", md.reduce_mean, lambda x, d: R.reduce("mean", x, d)),
    ("reduce_max", md.reduce_max, lambda x, d: R.reduce("max", x, d)),
    ("reduce_min", md.reduce_min, lambda x, d: R.reduce("min", x, d)),
    ("logsumexp", md.logsumexp, R.logsumexp),
    ("softmax", md.softmax, R.softmax),
    ("log_softmax", md.log_softmax, R.log_softmax),
]


def build_reduction(draw, h, pool):
    if not h:
        return None
    name, fn, ref = draw(st.sampled_from(REDUCTIONS))
    dims = draw(st.lists(st.sampled_from(list(h)), min_size=1, max_size=len(h), unique=True))
    return Step(f"{name}({' '.join(dims)})", lambda x: fn(x, dims), lambda x: ref(x, dims))


def _draw_weight_and_out(draw, h, pool):
    """A fresh weight's dims and an einsum output drawn from h's and the weight's; None if too big."""
    w = _draw_dims(draw, pool, min_rank=1)
    union = list(dict.fromkeys([*h, *w]))
    out = [n for n in draw(st.permutations(union)) if draw(st.booleans())][:MAX_RANK]
    return None if len(w) > MAX_RANK else (w, out)


def build_einsum(draw, h, pool):
    """einsum of h with a fresh weight: contracts some dims, keeps some, brings new ones."""
    drawn = _draw_weight_and_out(draw, h, pool)
    if drawn is None:
        return None
    w, out = drawn
    return Step(
        f"einsum(h, w[{_names(w)}], out=[{' '.join(out)}])",
        lambda h, w: md.einsum(h, w, out=out),
        lambda h, w: R.einsum(out, h, w),
        ((w, "normal"),),
    )


def build_einsum_sum(draw, h, pool):
    """einsum(h, w1) + einsum(h, w2) * s: pending partial sums added before the collective."""
    drawn = _draw_weight_and_out(draw, h, pool)
    if drawn is None:
        return None
    w, out = drawn
    return Step(
        f"einsum(h, w1[{_names(w)}]) + 0.5 * einsum(h, w2) over [{' '.join(out)}]",
        lambda h, w1, w2: md.einsum(h, w1, out=out) + 0.5 * md.einsum(h, w2, out=out),
        lambda h, w1, w2: R.einsum(out, h, w1) + 0.5 * R.einsum(out, h, w2),
        ((w, "normal"), (w, "normal")),
    )


OPS: list[tuple[str, Callable[..., Step | None]]] = [
    ("unary", build_unary),
    ("binary", build_binary),
    ("divide", build_divide),
    ("extremum", build_extremum),
    ("reduction", build_reduction),
    ("einsum", build_einsum),
    ("einsum_sum", build_einsum_sum),
]
"""The registry: (family, builder). Other op families append here."""


# ---- chains ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Chain:
    start: dict[str, int]
    steps: list[Step]

    @property
    def inputs(self) -> list[tuple[dict[str, int], str]]:
        return [(self.start, "normal")] + [f for s in self.steps for f in s.fresh]

    def _run(self, step_fn: Callable[[Step], Callable], x: Any, extras: tuple) -> Any:
        h, i = x, 0
        for s in self.steps:
            n = len(s.fresh)
            h = step_fn(s)(h, *extras[i : i + n])
            i += n
        return h

    def md_fn(self, x, *extras):
        return self._run(lambda s: s.md_fn, x, extras)

    def ref_fn(self, x, *extras):
        return self._run(lambda s: s.ref_fn, x, extras)

    def __repr__(self) -> str:
        return f"x[{_names(self.start)}] -> " + " -> ".join(map(repr, self.steps))


def _dims_after(step: Step, h: dict[str, int]) -> dict[str, int]:
    """The dims of ``step``'s result, from its reference on ones."""
    ones = lambda d: Named(np.ones(list(d.values())), list(d))  # noqa: E731
    return step.ref_fn(ones(h), *(ones(d) for d, _ in step.fresh)).sizes


@st.composite
def chains(draw, pool: dict[str, int], min_len: int = 2, max_len: int = 4) -> Chain:
    start = draw(S.sub_shape(pool))
    h, steps = start, []
    for _ in range(draw(st.integers(min_len, max_len))):
        step = None
        while step is None:
            _, build = draw(st.sampled_from(OPS))
            step = build(draw, h, pool)
        steps.append(step)
        h = _dims_after(step, h)
    return Chain(start, steps)


@settings(max_examples=S.examples(40))
@given(mesh=S.meshes(), pool=S.dim_pool(5), data=st.data(), rng=S.rngs())
def test_op_chains(mesh, pool, data, rng):
    cs = [data.draw(chains(pool), label=f"chain {k}") for k in range(CHAINS_PER_EXAMPLE)]
    layout = data.draw(S.layouts(mesh, pool), label="layout")
    args, spans = [], []
    for c in cs:
        spans.append(slice(len(args), len(args) + len(c.inputs)))
        args += [harness.rand(rng, d, kind) for d, kind in c.inputs]

    def fn(*a):
        return tuple(c.md_fn(*a[s]) for c, s in zip(cs, spans))

    def ref(*a):
        return tuple(c.ref_fn(*a[s]) for c, s in zip(cs, spans))

    assume(harness.check(fn, args, ref, mesh, layout))
