"""meshdsl.relayout: the plan (which steps), their price, and that applying them keeps the value.

* Unit tests assert exact step lists for the basic moves (split -> unsplit is one all-gather,
  unsplit -> split one local slice, a move between dims one all-to-all, a pending sum into a
  dim that wants its axis one psum_scatter, ...) and the bytes each step moves, by hand.
* A drawn test of the plan alone (no compile, many examples): the steps, applied to the layout
  state one by one, end exactly at the destination with no pending sums left.
* A drawn test runs ``relayout.apply`` inside a ``shard_map`` on the three meshes: a global
  array enters laid out as the source (possibly as per-device partial values whose sum over
  the pending axes is the array), leaves laid out as the destination, and is unchanged; and
  the compiled program runs exactly the collectives ``step_bytes`` prices.
"""

import math

import jax
import numpy as np
import pytest
from hypothesis import event, given, settings, strategies as st
from jax import lax
from jax.sharding import PartitionSpec

import strategies as S
from meshdsl import hlo, relayout
from meshdsl.collectives import Collective
from meshdsl.relayout import State, Step, StepKind

AG, A2A, PSUM, PS, SLICE = StepKind.ALL_GATHER, StepKind.ALL_TO_ALL, StepKind.PSUM, StepKind.PSUM_SCATTER, StepKind.SLICE

# (name, src, dst, pending, the steps)
PLANS = [
    ("split -> unsplit", (("model",), ()), ((), ()), (), (Step(AG, ("model",), 0),)),
    ("unsplit -> split", ((), ()), (("model",), ()), (), (Step(SLICE, ("model",), 0),)),
    ("move between dims", (("model",), ()), ((), ("model",)), (), (Step(A2A, ("model",), 1, 0),)),
    ("pending into a dim that wants the axis", ((), ()), ((), ("data",)), ("data",), (Step(PS, ("data",), 1),)),
    ("pending no dim wants", ((), ()), ((), ()), ("data", "model"), (Step(PSUM, ("data", "model")),)),
    ("pending: one scattered, one summed", ((), ()), ((), ("data",)), ("data", "model"), (Step(PS, ("data",), 1), Step(PSUM, ("model",)))),
    ("no change", (("data",), ("model",)), (("data",), ("model",)), (), ()),
    ("two axes gathered at once", (("data", "model"), ()), ((), ()), (), (Step(AG, ("data", "model"), 0),)),
    ("innermost axis gathered", (("data", "model"), ()), (("data",), ()), (), (Step(AG, ("model",), 0),)),
    ("inner axis added", (("data",), ()), (("data", "model"), ()), (), (Step(SLICE, ("model",), 0),)),
    (
        "module docstring example",
        (("model",), ()), ((), ("data", "model")), ("data",),
        (Step(PS, ("data",), 1), Step(A2A, ("model",), 1, 0)),
    ),
]


@pytest.mark.parametrize(("src", "dst", "pending", "steps"), [p[1:] for p in PLANS], ids=[p[0] for p in PLANS])
def test_plan(src, dst, pending, steps):
    assert relayout.plan(src, dst, pending) == steps


def test_plan_rejects_rank_change():
    with pytest.raises(ValueError, match="ranks 2 and 1"):
        relayout.plan(((), ()), ((),))


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
]


@pytest.mark.parametrize(("name", "total"), PRICES, ids=[p[0] for p in PRICES])
def test_step_bytes(name, total):
    _, src, dst, pending, _ = next(p for p in PLANS if p[0] == name)
    steps = relayout.plan(src, dst, pending)
    priced = relayout.step_bytes(steps, State(src, pending), (8, 16), 4, {"data": 4, "model": 2})
    assert sum(priced) == total


# ---- the plan on its own, drawn ----


@st.composite
def relayout_cases(draw, max_rank=3):
    """(mesh, global shape, src axes, dst axes, pending axes): all legal."""
    mesh = draw(S.meshes())
    shape = tuple(draw(st.lists(S.sizes(), min_size=1, max_size=max_rank)))
    pending = tuple(draw(st.lists(st.sampled_from(mesh.axis_names), unique=True, max_size=2)))
    src = draw(S.legal_axes(mesh, shape, exclude=pending))
    dst = draw(S.legal_axes(mesh, shape))
    return mesh, shape, src, dst, pending


@settings(max_examples=300)
@given(case=relayout_cases())
def test_plan_reaches_the_destination(case):
    _, _, src, dst, pending = case
    state = State(src, pending)
    for step in relayout.plan(src, dst, pending):
        if step.kind is AG:  # only innermost axes can be gathered
            assert state.axes[step.dim][-len(step.axes):] == step.axes
        if step.kind is A2A:
            assert state.axes[step.from_dim][-1:] == step.axes
        state = state.after(step)
    assert state == State(dst, ())


# ---- apply inside shard_map, drawn ----

CASES_PER_PROGRAM = 4


def _spec(axes):
    return PartitionSpec(*(None if not a else a[0] if len(a) == 1 else a for a in axes))


def _partial(x, y, pending, axis_sizes):
    """Per-device values whose sum over ``pending`` is x: x - K*y on the first device, (i+1)*y on device i."""
    if not pending:
        return x
    n = math.prod(axis_sizes[a] for a in pending)
    i = relayout.axis_index(pending, axis_sizes)
    k = (n - 1) * (n + 2) // 2  # sum of (i + 1) for i in 1..n-1
    return lax.select(i == 0, x - k * y, (i + 1).astype(x.dtype) * y)


def _predicted(cases, axis_sizes):
    """Collective counts and bytes the plans say, in meshdsl.hlo.summary's form."""
    out = {}
    for _, shape, src, dst, pending in cases:
        steps = relayout.plan(src, dst, pending)
        for step, b in zip(steps, relayout.step_bytes(steps, State(src, pending), shape, 4, axis_sizes)):
            c = step.kind.collective
            if c is not None and math.prod(axis_sizes[a] for a in step.axes) > 1:
                entry = out.setdefault(c.value, {"count": 0, "bytes": 0.0})
                entry["count"] += 1
                entry["bytes"] += b
    return {c.value: out[c.value] for c in Collective if c.value in out}


@settings(max_examples=60)
@given(mesh=S.meshes(), data=st.data(), rng=S.rngs())
def test_apply_keeps_the_value(mesh, data, rng):
    def case():
        shape = tuple(data.draw(st.lists(S.sizes(), min_size=1, max_size=3)))
        pending = tuple(data.draw(st.lists(st.sampled_from(mesh.axis_names), unique=True, max_size=2)))
        return mesh, shape, data.draw(S.legal_axes(mesh, shape, exclude=pending)), data.draw(S.legal_axes(mesh, shape)), pending

    cases = [data.draw(st.builds(case), label=f"case {k}") for k in range(CASES_PER_PROGRAM)]
    sizes = mesh.axis_sizes
    # Small integers in float32: the partial values and their sums are exact.
    xs = [rng.integers(-8, 9, shape).astype(np.float32) for _, shape, *_ in cases]
    ys = [rng.integers(-8, 9, shape).astype(np.float32) for _, shape, *_ in cases]

    def body(*arrays):
        out = []
        for (_, _, src, dst, pending), x, y in zip(cases, arrays[::2], arrays[1::2]):
            steps = relayout.plan(src, dst, pending)
            for step in steps:
                event(f"step {step.kind.value}")
            out.append(relayout.apply(_partial(x, y, pending, sizes), steps, sizes))
        return tuple(out)

    in_specs = tuple(_spec(src) for _, _, src, _, _ in cases for _ in range(2))
    out_specs = tuple(_spec(dst) for _, _, _, dst, _ in cases)
    program = jax.jit(jax.shard_map(body, mesh=mesh.jax_mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True))
    args = [a for x, y in zip(xs, ys) for a in (x, y)]
    results = program(*args)
    for (_, _, src, dst, pending), x, r in zip(cases, xs, results):
        np.testing.assert_array_equal(np.asarray(r), x, err_msg=f"{src} -> {dst} with pending {pending}")
        assert r.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh.jax_mesh, _spec(dst)), r.ndim)
    assert hlo.summary(program.lower(*args).compile().as_text()) == _predicted(cases, sizes)
