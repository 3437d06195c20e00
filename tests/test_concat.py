"""Ops that cut and join along one dim: concat, split, slice, pad, stack, unstack.

The drawn test applies all six to drawn tensors under a drawn layout (the cut or joined dim split
over one axis, a pair of axes, or not at all) and runs the full harness check: values against
numpy's concatenate / slicing / pad / stack on both backends, gradients, shardings, and
md.explain == the compiled HLO. The sizes it cuts to are multiples of the dim's split, so the
results can keep the layout; the offsets (slice begin, pad before) are not, so blocks do move.

The unit tests pin down docs/design.md's table: along a split dim each input is all-gathered
(then sliced back locally), along an unsplit dim nothing moves, and a new stacked dim that is
split is a local slice.
"""

import harness
import numpy as np
import pytest
import reference as R
import strategies as S
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

import meshdsl as md


def _with(dims, name, size, position=None):
    """``dims`` with ``name`` resized to ``size`` (and moved to ``position``, the others keeping their order)."""
    items = [(n, size if n == name else s) for n, s in dims.items()]
    if position is not None:
        moved = items.pop(list(dims).index(name))
        items.insert(position, moved)
    return dict(items)


@st.composite
def compositions(draw, total: int, unit: int, parts: int) -> list[int]:
    """``parts`` positive multiples of ``unit`` adding up to ``total`` (``total // unit >= parts``)."""
    cuts = sorted(
        draw(st.lists(st.integers(1, total // unit - 1), min_size=parts - 1, max_size=parts - 1, unique=True))
    )
    bounds = [0, *cuts, total // unit]
    return [(b - a) * unit for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=S.examples(14))
@given(mesh=S.meshes(), pool=S.dim_pool(3), data=st.data(), rng=S.rngs())
def test_concat_family(mesh, pool, data, rng):
    x = data.draw(S.sub_shape(pool, min_rank=1, max_rank=3), label="x dims")
    dim = data.draw(st.sampled_from(list(x)), label="dim")
    layout = data.draw(S.layouts_splitting(mesh, {**pool, "stacked": 2}, dim), label="layout")
    g = S.group_size(mesh, layout, dim)
    n = x[dim]
    blocks = max(n // g, 1)
    md_ops, ref_ops, inputs = {}, {}, {}

    # concat of two or three tensors, the others' dim at a drawn position and of a drawn size.
    k = data.draw(st.integers(2, 3), label="concat operands")
    others = [
        _with(
            x,
            dim,
            g * data.draw(st.integers(1, 3), label="operand size"),
            data.draw(st.integers(0, len(x) - 1), label="operand position"),
        )
        for _ in range(k - 1)
    ]
    inputs["concat"] = [x, *others]
    md_ops["concat"] = lambda *ts: md.concat(ts, dim)
    ref_ops["concat"] = lambda *ts: R.concat(ts, dim)

    parts = data.draw(st.sampled_from([p for p in range(1, blocks + 1) if blocks % p == 0]), label="split parts")
    inputs["split equal"] = [x]
    md_ops["split equal"] = lambda t: md.split(t, dim, parts)
    ref_ops["split equal"] = lambda t: R.split(t, dim, parts)

    if blocks >= 2:
        sizes = data.draw(
            compositions(n, g, data.draw(st.integers(2, min(blocks, 3)), label="parts")), label="split sizes"
        )
        inputs["split sizes"] = [x]
        md_ops["split sizes"] = lambda t: md.split(t, dim, sizes)
        ref_ops["split sizes"] = lambda t: R.split(t, dim, sizes)

    size = g * data.draw(st.integers(1, blocks), label="slice blocks") if n >= g else n
    begin = data.draw(st.integers(0, n - size), label="slice begin")
    inputs["slice"] = [x]
    md_ops["slice"] = lambda t: md.slice(t, begin, size, dim)
    ref_ops["slice"] = lambda t: R.slice_(t, begin, size, dim)

    added = g * data.draw(st.integers(1, 2), label="pad blocks")
    before = data.draw(st.integers(0, added), label="pad before")
    value = data.draw(st.sampled_from([0.0, 1.5]), label="pad value")
    inputs["pad"] = [x]
    md_ops["pad"] = lambda t: md.pad(t, [before, added - before], dim, value=value)
    ref_ops["pad"] = lambda t: R.pad(t, before, added - before, dim, value)

    axis = data.draw(st.integers(0, len(x)), label="stack axis")
    inputs["stack"] = [x, x]
    md_ops["stack"] = lambda a, b: md.stack([a, b], "stacked", axis=axis)
    ref_ops["stack"] = lambda a, b: R.stack([a, b], "stacked", axis)

    small = _with(x, dim, g if g > 1 else 2)  # unstack: one result per entry, so a short dim
    inputs["unstack"] = [small]
    md_ops["unstack"] = lambda t: md.unstack(t, dim)
    ref_ops["unstack"] = lambda t: R.unstack(t, dim)

    keys = list(md_ops)
    spans, args = [], []
    for key in keys:
        spans.append(slice(len(args), len(args) + len(inputs[key])))
        args += [harness.rand(rng, d) for d in inputs[key]]

    def fn(*ts):
        return {key: md_ops[key](*ts[s]) for key, s in zip(keys, spans)}

    def ref(*ts):
        return {key: ref_ops[key](*ts[s]) for key, s in zip(keys, spans)}

    assume(harness.check(fn, args, ref, mesh, layout, backends=data.draw(S.backends(), label="backends")))
    event(f"dim split over {len(layout.rules.get(dim, ()))} axes")


# ---- the layout cases of docs/design.md, by hand ----

X = {"a": 16, "b": 4}
"""f32[a=16, b=4]: cuts of a to multiples of 8 keep every split of the three meshes legal."""


def _x(seed, spec=X):
    return harness.rand(np.random.default_rng(seed), spec)


# (id, number of inputs, md function, reference)
OPS = {
    "concat a": (2, lambda x, y: md.concat([x, y], "a"), lambda x, y: R.concat([x, y], "a")),
    "concat b": (2, lambda x, y: md.concat([x, y], "b"), lambda x, y: R.concat([x, y], "b")),
    "split a": (1, lambda x: md.split(x, "a", [8, 8]), lambda x: R.split(x, "a", [8, 8])),
    "split b": (1, lambda x: md.split(x, "b", 2), lambda x: R.split(x, "b", 2)),
    "slice a": (1, lambda x: md.slice(x, 3, 8, "a"), lambda x: R.slice_(x, 3, 8, "a")),
    "slice b": (1, lambda x: md.slice(x, 1, 2, "b"), lambda x: R.slice_(x, 1, 2, "b")),
    "pad a": (1, lambda x: md.pad(x, [3, 5], "a", value=-1.0), lambda x: R.pad(x, 3, 5, "a", -1.0)),
    "pad b": (1, lambda x: md.pad(x, [1, 3], "b"), lambda x: R.pad(x, 1, 3, "b")),
    "stack": (2, lambda x, y: md.stack([x, y], "s", axis=1), lambda x, y: R.stack([x, y], "s", 1)),
    "unstack a": (1, lambda x: md.unstack(x, "a"), lambda x: R.unstack(x, "a")),
    "unstack b": (1, lambda x: md.unstack(x, "b"), lambda x: R.unstack(x, "b")),
}

# (op, mesh, layout, all-gathers expected): along the split dim, one all-gather per input.
CASES = [
    ("concat a", "data4_model2", {"a": "data", "b": "model"}, 2),
    ("concat a", "a2_b2_c2", {"a": ("c", "a"), "b": "b"}, 2),
    ("concat b", "data4_model2", {"a": "data"}, 0),
    ("concat b", "a2_b2_c2", {"a": ("a", "b", "c")}, 0),
    ("split a", "data4_model2", {"a": ("data", "model")}, 1),
    ("split a", "x8", {"a": "x"}, 1),
    ("split b", "data4_model2", {"a": "data", "b": "model"}, 1),
    ("slice a", "data4_model2", {"a": "model", "b": "data"}, 1),
    ("slice a", "a2_b2_c2", {"a": ("b", "a")}, 1),
    ("pad a", "data4_model2", {"a": "data", "b": "model"}, 1),
    ("pad b", "a2_b2_c2", {"a": ("a", "b"), "b": "c"}, 1),
    ("pad b", "data4_model2", {"a": ("data", "model")}, 0),
    # stack: the new dim split is a local slice of the stacked local blocks; other splits stay.
    ("stack", "data4_model2", {"a": "data", "s": "model"}, 0),
    ("stack", "a2_b2_c2", {"a": ("a", "b"), "s": "c"}, 0),
    ("unstack a", "data4_model2", {"a": "data", "b": "model"}, 1),
    ("unstack b", "data4_model2", {"a": "data"}, 0),
    ("unstack b", "a2_b2_c2", {"b": ("c", "a"), "a": "b"}, 1),
]


@pytest.mark.parametrize(("name", "mesh", "layout", "gathers"), CASES, ids=[f"{c[0]}-{c[1]}-{c[3]}" for c in CASES])
def test_layout_case(name, mesh, layout, gathers):
    n, fn, ref = OPS[name]
    m = harness.mesh(mesh)
    args = [_x(i) for i in range(n)]
    assert harness.check(fn, args, ref, m, layout)
    summary = md.explain(fn, m, layout, *args).summary()
    assert set(summary) <= {"all-gather"}, summary
    assert summary.get("all-gather", {"count": 0})["count"] == gathers, summary


def test_concat_along_split_dim_bytes():
    # Two f32[a=16, b=4] inputs, a split over data (4): each gathers its [4, 4] blocks into
    # [16, 4] (256 bytes): 3/4 * 256 = 192 bytes each.
    m, layout = harness.mesh("data4_model2"), {"a": "data"}
    _, fn, _ = OPS["concat a"]
    assert md.explain(fn, m, layout, _x(0), _x(1)).summary() == {"all-gather": {"count": 2, "bytes": 384.0}}


def test_concat_operands_with_the_dim_elsewhere():
    # y has the joined dim in another position: it is moved to x's position; other dims agree.
    m, layout = harness.mesh("data4_model2"), {"a": "model", "b": "data"}
    x, y = _x(0), _x(1, {"b": 4, "a": 2})

    def fn(x, y):
        return md.concat([x, y], "a")

    assert harness.check(fn, [x, y], lambda x, y: R.concat([x, y], "a"), m, layout)


def test_cut_errors_are_shape_errors():
    x = _x(0)
    with pytest.raises(md.ShapeError):
        md.split(x, "a", 3)
    with pytest.raises(md.ShapeError):
        md.split(x, "a", [4, 5])
    with pytest.raises(md.ShapeError):
        md.split(x, "a", 0)
    with pytest.raises(md.ShapeError):
        md.slice(x, 14, 4, "a")
    with pytest.raises(md.ShapeError):
        md.pad(x, [-1, 2], "a")
    with pytest.raises(md.ShapeError):
        md.concat([x, _x(1, {"a": 16, "b": 2})], "a")
    with pytest.raises(md.ShapeError):
        md.stack([x, _x(1, {"a": 4, "b": 4})], "s")
