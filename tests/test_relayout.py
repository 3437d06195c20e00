"""meshdsl.relayout: the plan is the cheapest, its steps are priced right, and applying it keeps the value.

* Unit tests assert exact step lists for the basic moves (split -> unsplit is one all-gather,
  unsplit -> split one local slice, a move between dims one all-to-all, a pending sum into a
  dim that wants its axis one psum_scatter, the issue's two plans, ...) and the bytes, by hand.
* *The plan is the cheapest, proved by brute force.* For every mesh and shape of ``EXHAUSTIVE``
  (1 to 3 axes of sizes 2 to 4, tensors of rank 1 to 3) and EVERY source layout, pending-sum set
  and destination layout, the bytes of ``plan`` equal the minimum over all step sequences, and
  its collectives the fewest among the cheapest. The minimum comes from this file's own search:
  it lists the layouts, decides for every ordered pair of layouts whether one step joins them
  and at what price (the ring model, written out here again), and runs Floyd-Warshall on exact
  integer prices. Each step of the plan is checked against that relation too, from its own
  fields: legal, priced by ``step_bytes`` as the relation prices it, ending at the destination.
* *Applying keeps the value.* Per mesh of at most 8 devices, one ``shard_map`` program runs a
  set of relayouts that uses every distinct step any plan takes on that mesh and shape; each
  device's input is built in numpy (its block of the source, as partial values whose sum over
  the pending axes is the block), and its output must equal its numpy block of the destination.
  The compiled program runs exactly the collectives ``step_bytes`` prices. A drawn test does
  the same on the harness meshes with drawn shapes.
* Through ``md.compile``: results relayouted by ``out_layouts`` (the issue's two reproductions)
  move what ``md.explain`` says, which is the brute-force minimum and what the compiled HLO moves.
"""

import functools
import itertools
import math
from fractions import Fraction

import jax
import numpy as np
import pytest
import strategies as S
from hypothesis import event, given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import Mesh, PartitionSpec

import meshdsl as md
from meshdsl import relayout
from meshdsl.analysis import hlo
from meshdsl.collectives import Collective
from meshdsl.lowering import relayout_run
from meshdsl.relayout import State, Step, StepKind

AG, A2A, PSUM, PS, SLICE = (
    StepKind.ALL_GATHER,
    StepKind.ALL_TO_ALL,
    StepKind.PSUM,
    StepKind.PSUM_SCATTER,
    StepKind.SLICE,
)

AXES = {"data": 4, "model": 2}
SHAPE = (8, 16)

# (name, src, dst, pending, the steps), for a [8, 16] tensor on data=4 model=2
PLANS = [
    ("split -> unsplit", (("model",), ()), ((), ()), (), (Step(AG, ("model",), 0),)),
    ("unsplit -> split", ((), ()), (("model",), ()), (), (Step(SLICE, ("model",), 0),)),
    ("move between dims", (("model",), ()), ((), ("model",)), (), (Step(A2A, ("model",), 1, 0),)),
    ("pending into a dim that wants the axis", ((), ()), ((), ("data",)), ("data",), (Step(PS, ("data",), 1),)),
    ("pending no dim wants", ((), ()), ((), ()), ("data", "model"), (Step(PSUM, ("data", "model")),)),
    (
        "pending: one scattered, one summed",
        ((), ()),
        ((), ("data",)),
        ("data", "model"),
        (Step(PS, ("data",), 1), Step(PSUM, ("model",))),
    ),
    ("no change", (("data",), ("model",)), (("data",), ("model",)), (), ()),
    ("two axes gathered at once", (("data", "model"), ()), ((), ()), (), (Step(AG, ("data", "model"), 0),)),
    ("innermost axis gathered", (("data", "model"), ()), (("data",), ()), (), (Step(AG, ("model",), 0),)),
    ("inner axis added", (("data",), ()), (("data", "model"), ()), (), (Step(SLICE, ("model",), 0),)),
    # the first reproduction: slice first, then reduce-scatter (not all-reduce, then slice)
    (
        "pending wanted minor: slice, then scatter",
        ((), ()),
        (("model", "data"), ()),
        ("data",),
        (Step(SLICE, ("model",), 0), Step(PS, ("data",), 0)),
    ),
    # the second (the module docstring's example): data leaves dim 0 and comes back behind model
    (
        "axis added in front",
        (("data",), ()),
        (("model", "data"), ()),
        (),
        (Step(SLICE, ("model",), 1), Step(A2A, ("data",), 1, 0), Step(A2A, ("model", "data"), 0, 1)),
    ),
    (
        "two axes moved, order reversed",
        (("data", "model"), ()),
        ((), ("model", "data")),
        (),
        (Step(A2A, ("model", "data"), 1, 0, ("data", "model")),),
    ),
    (
        "scatter into an unsplit dim, then move",
        (("model",), ()),
        ((), ("data", "model")),
        ("data",),
        (Step(PS, ("data",), 1), Step(A2A, ("model",), 1, 0)),
    ),
]


@pytest.mark.parametrize(("src", "dst", "pending", "steps"), [p[1:] for p in PLANS], ids=[p[0] for p in PLANS])
def test_plan(src, dst, pending, steps):
    assert relayout.plan(src, dst, pending, SHAPE, AXES) == steps


def test_plan_rejects_what_is_no_layout():
    with pytest.raises(ValueError, match="ranks 2 and 1"):
        relayout.plan(((), ()), ((),), (), SHAPE, AXES)
    with pytest.raises(ValueError, match="not a legal layout"):
        relayout.plan((("data", "model"), ()), ((), ()), (), (4, 16), AXES)  # 4 rows over 8 devices
    with pytest.raises(ValueError, match="not a legal layout"):
        relayout.plan((("data",), ()), ((), ()), ("data",), SHAPE, AXES)  # split and pending at once
    with pytest.raises(ValueError, match="lacks"):
        relayout.plan((("stage",), ()), ((), ()), (), SHAPE, AXES)


# Bytes per device, by hand, for a f32[8, 16] tensor (512 bytes) on data=4 model=2.
PRICES = [
    # all-gather over model into the full 512 bytes: (2-1)/2 * 512
    ("split -> unsplit", 256.0),
    ("unsplit -> split", 0.0),
    # all-to-all of the [4, 16] shard (256 bytes) over 2 devices: 1/2 * 256
    ("move between dims", 128.0),
    # reduce-scatter of the full 512 bytes over data (4): 3/4 * 512
    ("pending into a dim that wants the axis", 384.0),
    # all-reduce of 512 bytes over 8 devices: 2 * 7/8 * 512
    ("pending no dim wants", 896.0),
    # 3/4 * 512, then all-reduce over model of the [8, 4] shard (128 bytes): 2 * 1/2 * 128
    ("pending: one scattered, one summed", 384.0 + 128.0),
    # all-gather over data x model into 512 bytes: 7/8 * 512
    ("two axes gathered at once", 448.0),
    # reduce-scatter over data of the [4, 16] slice (256 bytes): 3/4 * 256 (all-reduce and slice: 2 * 3/4 * 512)
    ("pending wanted minor: slice, then scatter", 192.0),
    # [2, 8] (64 bytes) over data: 3/4 * 64; then [8, 2] (64 bytes) over model x data: 7/8 * 64
    ("axis added in front", 48.0 + 56.0),
    # [1, 16] (64 bytes) over 8 devices at once: 7/8 * 64 (one axis at a time: 1/2 * 64 + 3/4 * 64)
    ("two axes moved, order reversed", 56.0),
]


@pytest.mark.parametrize(("name", "total"), PRICES, ids=[p[0] for p in PRICES])
def test_step_bytes(name, total):
    _, src, dst, pending, _ = next(p for p in PLANS if p[0] == name)
    steps = relayout.plan(src, dst, pending, SHAPE, AXES)
    assert sum(relayout.step_bytes(steps, State(src, pending), SHAPE, 4, AXES)) == total


# ---- the plan is the cheapest: an exhaustive search of our own ----

ITEMSIZE = 4


def _fits(size, axes, axis_sizes):
    return size % math.prod(axis_sizes[a] for a in axes) == 0


@functools.cache
def _layouts(axis_items, shape):
    """Every (per-dim axes, frozenset of pending axes): each axis unused, pending, or inserted at any place of any
    dim."""
    axis_sizes = dict(axis_items)
    out = [(((),) * len(shape), frozenset())]
    for a in axis_sizes:
        grown = []
        for dims, pending in out:
            grown += [(dims, pending), (dims, pending | {a})]
            for d, have in enumerate(dims):
                grown += [
                    (dims[:d] + (have[:k] + (a,) + have[k:],) + dims[d + 1 :], pending) for k in range(len(have) + 1)
                ]
        out = grown
    return tuple((dims, p) for dims, p in out if all(_fits(s, d, axis_sizes) for s, d in zip(shape, dims)))


@functools.cache
def _one_step(s, t, axis_items, shape):
    """(step kind, bytes per device) of the single step from layout ``s`` to ``t``, or None.

    The ring model, by the buffer each collective sees: ``L`` the local bytes before, ``n`` the group.
    """
    axis_sizes = dict(axis_items)
    (sd, sp), (td, tp) = s, t
    total = math.prod(shape) * ITEMSIZE

    def local(dims):
        return Fraction(total, math.prod(axis_sizes[a] for d in dims for a in d))

    def frac(axes):
        n = math.prod(axis_sizes[a] for a in axes)
        return Fraction(n - 1, n)

    def grows(a, b):  # b is a followed by more axes
        return len(b) > len(a) and b[: len(a)] == a

    changed = [d for d in range(len(shape)) if sd[d] != td[d]]
    if tp < sp:
        summed = sp - tp
        if not changed:
            return PSUM, 2 * frac(summed) * local(sd)
        if (
            len(changed) == 1
            and grows(sd[changed[0]], td[changed[0]])
            and set(td[changed[0]][len(sd[changed[0]]) :]) == summed
        ):
            return PS, frac(summed) * local(sd)
        return None
    if tp != sp:
        return None
    if len(changed) == 1:
        (d,) = changed
        if grows(td[d], sd[d]):
            return AG, frac(sd[d][len(td[d]) :]) * local(td)
        if grows(sd[d], td[d]):
            return SLICE, Fraction(0)
    if len(changed) == 2:
        for i, j in (changed, changed[::-1]):
            if (
                grows(td[i], sd[i])
                and grows(sd[j], td[j])
                and sorted(sd[i][len(td[i]) :]) == sorted(td[j][len(sd[j]) :])
            ):
                return A2A, frac(td[j][len(sd[j]) :]) * local(sd)
    return None


@functools.cache
def _cheapest(axis_sizes_items, shape):
    """The layouts over these axes, and for every pair the least (bytes, collectives), by Floyd-Warshall.

    Prices are scaled to integers; a path's key is ``bytes * K + collectives`` with ``K`` above
    any path's number of collectives, so the least key is the least bytes, then collectives.
    """
    nodes = _layouts(axis_sizes_items, shape)
    edges = {}
    for i, s in enumerate(nodes):
        for j, t in enumerate(nodes):
            step = _one_step(s, t, axis_sizes_items, shape) if i != j else None
            if step is not None:
                edges[i, j] = step
    scale = math.lcm(*(price.denominator for _, price in edges.values()))
    k = len(nodes) + 1
    inf = 2**60
    dist = np.full((len(nodes), len(nodes)), inf, np.int64)
    np.fill_diagonal(dist, 0)
    for (i, j), (kind, price) in edges.items():
        dist[i, j] = int(price * scale) * k + (kind is not SLICE)
    for m in range(len(nodes)):
        dist = np.minimum(dist, dist[:, m : m + 1] + dist[m : m + 1, :])
    return nodes, dist, scale, k


def _after(state, step, axis_sizes, shape):
    """The layout ``step`` leads to, read from the step's own fields; asserts the step can run."""
    dims, pending = list(state[0]), state[1]
    n = len(step.axes)
    if step.kind in (PSUM, PS):
        assert set(step.axes) <= pending, step
        pending = pending - set(step.axes)
    if step.kind in (PS, SLICE):
        dims[step.dim] += step.axes
    if step.kind is AG:
        assert dims[step.dim][-n:] == step.axes, (state, step)
        dims[step.dim] = dims[step.dim][:-n]
    if step.kind is A2A:
        held = step.from_axes or step.axes
        assert sorted(held) == sorted(step.axes) and dims[step.from_dim][-n:] == held, (state, step)
        dims[step.from_dim] = dims[step.from_dim][:-n]
        dims[step.dim] += step.axes
    after = (tuple(dims), pending)
    assert after in _legal(tuple(axis_sizes.items()), shape), (state, step)
    return after


@functools.cache
def _legal(axis_items, shape):
    return frozenset(_layouts(axis_items, shape))


def _touched(src, dst, pending):
    return {a for dims in (src, dst) for d in dims for a in d} | set(pending)


# Meshes of 1 to 3 axes of sizes 2 to 4; shapes whose dims take every axis, and some that do not.
EXHAUSTIVE = [
    ({"a": 2}, (2,)),
    ({"a": 3}, (6, 3)),
    ({"a": 4}, (4, 2, 4)),
    ({"a": 2, "b": 2}, (4,)),
    ({"a": 2, "b": 2}, (4, 4)),
    ({"a": 2, "b": 2}, (4, 2, 4)),
    ({"a": 2, "b": 3}, (6, 6)),
    ({"a": 2, "b": 3}, (6, 2, 3)),
    ({"a": 2, "b": 4}, (8, 8)),
    ({"a": 4, "b": 2}, (8, 4)),
    ({"a": 3, "b": 4}, (12, 12)),
    ({"a": 4, "b": 4}, (16, 4, 4)),
    ({"a": 2, "b": 2, "c": 2}, (8,)),
    ({"a": 2, "b": 2, "c": 2}, (8, 8)),
    ({"a": 2, "b": 2, "c": 2}, (8, 4, 2)),
    ({"a": 2, "b": 3, "c": 4}, (24, 24)),
    ({"a": 4, "b": 2, "c": 3}, (24, 8)),
]


@pytest.mark.parametrize(
    ("axis_sizes", "shape"), EXHAUSTIVE, ids=[f"{'x'.join(map(str, m.values()))}-{s}" for m, s in EXHAUSTIVE]
)
def test_plan_is_the_cheapest(axis_sizes, shape):
    names = list(axis_sizes)
    checked = 0
    for r in range(len(names) + 1):
        for touched in itertools.combinations(names, r):
            # a plan only uses the axes the relayout touches: search over those alone
            sub = {a: axis_sizes[a] for a in touched}
            nodes, dist, scale, k = _cheapest(tuple(sub.items()), shape)
            index = {node: i for i, node in enumerate(nodes)}
            for (src, pending), (dst, dst_pending) in itertools.product(nodes, nodes):
                if dst_pending or _touched(src, dst, pending) != set(touched):
                    continue
                steps = relayout.plan(src, dst, tuple(pending), shape, axis_sizes)
                state, priced = (
                    (src, pending),
                    relayout.step_bytes(steps, State(src, tuple(pending)), shape, ITEMSIZE, axis_sizes),
                )
                for step, b in zip(steps, priced):
                    after = _after(state, step, sub, shape)
                    kind, price = _one_step(state, after, tuple(sub.items()), shape)
                    assert kind is step.kind and math.isclose(b, price, rel_tol=1e-12), (state, step)
                    state = after
                assert state == (dst, frozenset())
                least = dist[index[src, pending], index[dst, frozenset()]]
                case = f"{src} -> {dst} with pending {sorted(pending)}: {steps}"
                assert math.isclose(sum(priced), Fraction(int(least // k), scale), rel_tol=1e-12), case
                assert sum(s.kind is not SLICE for s in steps) == least % k, case
                checked += 1
    every = _layouts(tuple(axis_sizes.items()), shape)
    assert checked == sum(not p for _, p in every) * len(every)


# ---- applying a plan keeps the value: every step on a mesh, one program ----


def _block(x, dims, coords, axis_sizes):
    """The block of global ``x`` a device at mesh ``coords`` holds under per-dim ``dims``."""
    index = []
    for size, axes in zip(x.shape, dims):
        n = math.prod(axis_sizes[a] for a in axes)
        i = 0
        for a in axes:
            i = i * axis_sizes[a] + coords[a]
        index.append(slice(i * size // n, (i + 1) * size // n))
    return x[tuple(index)]


def _cover(axis_sizes, shape):
    """Relayouts (src, pending, dst) whose plans, together, take every kind of step over every
    group of axes in every order that any plan takes here: for each, the shortest such plan."""
    nodes = _layouts(tuple(axis_sizes.items()), shape)
    plans = [
        ((src, tuple(sorted(pending)), dst), relayout.plan(src, dst, tuple(pending), shape, axis_sizes))
        for (src, pending), (dst, dst_pending) in itertools.product(nodes, nodes)
        if not dst_pending
    ]
    first = {}
    for case, steps in sorted(plans, key=lambda p: len(p[1])):
        for step in steps:
            first.setdefault((step.kind, step.axes, step.from_axes), case)
    return sorted(set(first.values()))


APPLY = [
    ({"a": 2}, (4, 2)),
    ({"a": 3}, (3, 6)),
    ({"a": 4}, (4, 4)),
    ({"a": 2, "b": 2}, (4, 4)),
    ({"a": 2, "b": 3}, (6, 6)),
    ({"a": 2, "b": 4}, (8, 8)),
    ({"a": 4, "b": 2}, (8, 4)),
    ({"a": 2, "b": 2, "c": 2}, (8, 8)),
]


@pytest.mark.parametrize(
    ("axis_sizes", "shape"), APPLY, ids=[f"{'x'.join(map(str, m.values()))}-{s}" for m, s in APPLY]
)
def test_apply_every_step(axis_sizes, shape):
    names = tuple(axis_sizes)
    devices = math.prod(axis_sizes.values())
    mesh = Mesh(np.array(jax.devices()[:devices]).reshape(tuple(axis_sizes.values())), names)
    cases = _cover(axis_sizes, shape)
    rng = np.random.default_rng(0)
    all_coords = [dict(zip(names, c)) for c in itertools.product(*(range(n) for n in axis_sizes.values()))]
    inputs, wanted = [], []
    for src, pending, dst in cases:
        x = rng.integers(-8, 9, shape).astype(np.float32)
        n = math.prod(axis_sizes[a] for a in pending)
        parts = rng.integers(-8, 9, (n, *x.shape)).astype(np.float32)
        parts[0] = x - parts[1:].sum(0)  # the parts add up to x; small integers, exact in float32
        rows = []
        for c in all_coords:
            q = 0
            for a in pending:
                q = q * axis_sizes[a] + c[a]
            rows.append(_block(parts[q], src, c, axis_sizes))
        inputs.append(np.stack(rows))
        wanted.append(np.stack([_block(x, dst, c, axis_sizes) for c in all_coords]))

    def body(*arrays):
        out = []
        for (src, pending, dst), a in zip(cases, arrays):
            out.append(relayout_run.apply(a[0], relayout.plan(src, dst, pending, shape, axis_sizes), axis_sizes)[None])
        return tuple(out)

    spec = PartitionSpec(names)  # one row per device, in mesh order
    program = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(cases), out_specs=(spec,) * len(cases), check_vma=False)
    )
    compiled = program.lower(*inputs).compile()
    for (src, pending, dst), got, want in zip(cases, compiled(*inputs), wanted):
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"{src} -> {dst} with pending {pending}")
    predicted = _predicted([(shape, src, dst, pending) for src, pending, dst in cases], axis_sizes)
    assert hlo.summary(compiled.as_text()) == predicted


def _predicted(cases, axis_sizes):
    """Collective counts and bytes the plans say, in meshdsl.analysis.hlo.summary's form."""
    out = {}
    for shape, src, dst, pending in cases:
        steps = relayout.plan(src, dst, pending, shape, axis_sizes)
        for step, b in zip(steps, relayout.step_bytes(steps, State(src, pending), shape, 4, axis_sizes)):
            c = step.kind.collective
            if c is not None and math.prod(axis_sizes[a] for a in step.axes) > 1:
                entry = out.setdefault(c.value, {"count": 0, "bytes": 0.0})
                entry["count"] += 1
                entry["bytes"] += b
    return {c.value: out[c.value] for c in Collective if c.value in out}


# ---- drawn: the harness meshes, drawn shapes ----


@st.composite
def relayout_cases(draw, max_rank=3):
    """(mesh, global shape, src axes, dst axes, pending axes): all legal."""
    mesh = draw(S.meshes())
    shape = tuple(draw(st.lists(S.sizes(), min_size=1, max_size=max_rank)))
    pending = tuple(draw(st.lists(st.sampled_from(mesh.axis_names), unique=True, max_size=2)))
    src = draw(S.legal_axes(mesh, shape, exclude=pending))
    dst = draw(S.legal_axes(mesh, shape))
    return mesh, shape, src, dst, pending


@settings(max_examples=S.examples(100))
@given(case=relayout_cases())
def test_plan_reaches_the_destination(case):
    mesh, shape, src, dst, pending = case
    state = State(src, pending)
    for step in relayout.plan(src, dst, pending, shape, mesh.axis_sizes):
        if step.kind is AG:  # only innermost axes can be gathered
            assert state.axes[step.dim][-len(step.axes) :] == step.axes
        if step.kind is A2A:
            assert state.axes[step.from_dim][-len(step.axes) :] == (step.from_axes or step.axes)
        state = state.after(step)
    assert state == State(dst, ())


CASES_PER_PROGRAM = 4


def _spec(axes):
    return PartitionSpec(*(None if not a else a[0] if len(a) == 1 else a for a in axes))


def _partial(x, y, pending, axis_sizes):
    """Per-device values whose sum over ``pending`` is x: x - K*y on the first device, (i+1)*y on device i."""
    if not pending:
        return x
    n = math.prod(axis_sizes[a] for a in pending)
    i = relayout_run.axis_index(pending, axis_sizes)
    k = (n - 1) * (n + 2) // 2  # sum of (i + 1) for i in 1..n-1
    return lax.select(i == 0, x - k * y, (i + 1).astype(x.dtype) * y)


@settings(max_examples=S.examples(20))
@given(mesh=S.meshes(), data=st.data(), rng=S.rngs())
def test_apply_keeps_the_value(mesh, data, rng):
    def case():
        shape = tuple(data.draw(st.lists(S.sizes(), min_size=1, max_size=3)))
        pending = tuple(data.draw(st.lists(st.sampled_from(mesh.axis_names), unique=True, max_size=2)))
        return (
            mesh,
            shape,
            data.draw(S.legal_axes(mesh, shape, exclude=pending)),
            data.draw(S.legal_axes(mesh, shape)),
            pending,
        )

    cases = [data.draw(st.builds(case), label=f"case {k}") for k in range(CASES_PER_PROGRAM)]
    sizes = mesh.axis_sizes
    # Small integers in float32: the partial values and their sums are exact.
    xs = [rng.integers(-8, 9, shape).astype(np.float32) for _, shape, *_ in cases]
    ys = [rng.integers(-8, 9, shape).astype(np.float32) for _, shape, *_ in cases]

    def body(*arrays):
        out = []
        for (_, shape, src, dst, pending), x, y in zip(cases, arrays[::2], arrays[1::2]):
            steps = relayout.plan(src, dst, pending, shape, sizes)
            for step in steps:
                event(f"step {step.kind.value}")
            out.append(relayout_run.apply(_partial(x, y, pending, sizes), steps, sizes))
        return tuple(out)

    in_specs = tuple(_spec(src) for _, _, src, _, _ in cases for _ in range(2))
    out_specs = tuple(_spec(dst) for _, _, _, dst, _ in cases)
    program = jax.jit(jax.shard_map(body, mesh=mesh.jax_mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True))
    args = [a for x, y in zip(xs, ys) for a in (x, y)]
    compiled = program.lower(*args).compile()
    results = compiled(*args)
    for (_, _, src, dst, pending), x, r in zip(cases, xs, results):
        np.testing.assert_array_equal(np.asarray(r), x, err_msg=f"{src} -> {dst} with pending {pending}")
        assert r.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh.jax_mesh, _spec(dst)), r.ndim)
    predicted = _predicted([(shape, src, dst, pending) for _, shape, src, dst, pending in cases], sizes)
    assert hlo.summary(compiled.as_text()) == predicted


# ---- through md.compile: a result relayouted by out_layouts ----


def _least_bytes(axis_sizes, shape, src, pending, dst):
    """The brute-force minimum of bytes per device from (src, pending) to dst, f32."""
    touched = _touched(src, dst, pending)
    nodes, dist, scale, k = _cheapest(tuple((a, n) for a, n in axis_sizes.items() if a in touched), shape)
    least = dist[nodes.index((src, frozenset(pending))), nodes.index((dst, frozenset()))]
    return Fraction(int(least // k), scale)


def _outer(x, y):  # [batch, m] x [batch, n] -> [m, n]: a partial sum over batch's axes
    return md.einsum(x, y, out=["m", "n"])


def _copy(z):  # z, laid out as in_layouts gave it
    return z * 1.0


# The two reproductions, an f32 [m=64, n=16] result on data=4 model=2 (the old rule moved
# 6,144 and 3,072 bytes): (name, fn, layout, in_layouts, the result's layout and pending sums
# before the relayout to m: (model, data)).
OUT_LAYOUTS = [
    ("partial sum to (model, data)", _outer, {"batch": "data"}, None, ((), ()), ("data",)),
    ("(data,) to (model, data)", _copy, {}, ({"m": "data"},), (("data",), ()), ()),
]


@pytest.mark.parametrize(
    ("fn", "layout", "in_layouts", "src", "pending"), [c[1:] for c in OUT_LAYOUTS], ids=[c[0] for c in OUT_LAYOUTS]
)
def test_out_layouts_move_the_least_bytes(fn, layout, in_layouts, src, pending):
    mesh = md.Mesh(AXES)
    rng = np.random.default_rng(3)
    x = rng.integers(-4, 5, (8, 64)).astype(np.float32)
    y = rng.integers(-4, 5, (8, 16)).astype(np.float32)
    if fn is _outer:
        args, want = (md.tensor(x, "batch m"), md.tensor(y, "batch n")), x.T @ y
    else:
        args, want = (md.tensor(x.T @ y, "m n"),), x.T @ y
    out_layout = {"m": ("model", "data")}
    compiled = md.compile(fn, mesh, layout, in_layouts=in_layouts, out_layouts=out_layout)
    np.testing.assert_array_equal(compiled(*args).numpy(), want)
    report = md.explain(fn, mesh, layout, *args, in_layouts=in_layouts, out_layouts=out_layout)
    assert report.total_bytes == _least_bytes(AXES, (64, 16), src, pending, (("model", "data"), ()))
    assert report.summary() == hlo.summary(compiled.lower(*args).compile().as_text())


# ---- the gradient of a relayout is the cheapest relayout back ----


@pytest.mark.parametrize(
    ("axis_sizes", "shape"), APPLY, ids=[f"{'x'.join(map(str, m.values()))}-{s}" for m, s in APPLY]
)
def test_gradient_moves_the_least_bytes_back(axis_sizes, shape):
    """The gradient of relayout ``src -> dst`` is the cotangent moved ``dst -> src``: its values are
    the cotangent's blocks (numpy), and its bytes the brute-force minimum of that relayout. A free
    slice of a replicated value has an all-gather for its gradient, not an all-reduce of copies
    padded with zeros (twice the bytes); JAX derives the rest (an all-gather's gradient is a local
    slice, an all-to-all's the reverse all-to-all)."""
    names = tuple(axis_sizes)
    mesh = Mesh(np.array(jax.devices()[: math.prod(axis_sizes.values())]).reshape(tuple(axis_sizes.values())), names)
    cases = [(src, dst) for src, pending, dst in _cover(axis_sizes, shape) if not pending]
    rng = np.random.default_rng(1)
    cts = [rng.integers(-8, 9, shape).astype(np.float32) for _ in cases]

    def body(*arrays):
        xs, cs = arrays[: len(cases)], arrays[len(cases) :]
        out = []
        for (src, dst), x, c in zip(cases, xs, cs):
            steps = relayout.plan(src, dst, (), shape, axis_sizes)
            _, pull = jax.vjp(lambda v, steps=steps: relayout_run.apply(v, steps, axis_sizes), x)
            out.append(pull(c)[0])
        return tuple(out)

    in_specs = tuple(_spec(src) for src, _ in cases) + tuple(_spec(dst) for _, dst in cases)
    program = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=tuple(_spec(src) for src, _ in cases))
    )
    args = [np.zeros(shape, np.float32) for _ in cases] + cts
    compiled = program.lower(*args).compile()
    for (src, dst), got, ct in zip(cases, compiled(*args), cts):
        np.testing.assert_array_equal(np.asarray(got), ct, err_msg=f"gradient of {src} -> {dst}")
    moved = sum(entry["bytes"] for entry in hlo.summary(compiled.as_text()).values())
    least = sum(_least_bytes(axis_sizes, shape, dst, (), src) for src, dst in cases)
    assert moved == least


def test_replicated_weight_used_split_gets_its_gradient_gathered():
    """The issue's reproduction: ``w[d, d_ff]`` stored replicated, used under ``d_ff:model`` on
    ``model=8``. Its gradient is one all-gather of the blocks' gradients (7/8 of 3,584 bytes), not
    an all-reduce of zero-padded copies (2 x 7/8 of them); values against jax.numpy."""
    mesh = md.Mesh({"model": 8})
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 16)).astype(np.float32)
    w = rng.standard_normal((16, 56)).astype(np.float32)

    def loss(x, w):
        return md.reduce_sum(md.relu(md.einsum(x, w, out=["batch", "d_ff"]))).array

    args = (md.tensor(x, "batch d"), md.tensor(w, "d d_ff"))
    layouts = (None, md.Layout(""))
    f = md.compile(jax.grad(loss, argnums=1), mesh, "d_ff:model", in_layouts=layouts)
    want = jax.grad(lambda w: jax.numpy.sum(jax.nn.relu(x @ w)))(w)
    np.testing.assert_allclose(f(*args).numpy(), want, rtol=1e-6, atol=1e-6)
    report = md.explain(jax.grad(loss, argnums=1), mesh, "d_ff:model", *args, in_layouts=layouts)
    assert report.summary() == hlo.summary(f.lower(*args).compile().as_text())
    assert report.summary() == {"all-gather": {"count": 1, "bytes": 7 / 8 * 16 * 56 * 4}}
