"""Index ops: range, one_hot, gather, top_k, argmax, cumsum, shift.

Drawn tests (full harness check: values against numpy on both backends, gradients where the op
is differentiable, shardings, md.explain == compiled HLO):

* one_hot and range into a drawn (often split) dim, from indices with out-of-range and negative
  values; no collective, whatever the layout;
* gather from drawn weights at drawn indices (out of range and negative ones give zeros), the
  gathered dim often split (vocab-parallel) and sometimes sharing an axis with a dim of the
  indices (the compute layout must resolve the clash), alone and as a sum of two gathers whose
  partial sums are added once; gradient with respect to the weights;
* top_k (values and indices; ties to the lower index) and argmax (ties to the lowest index, as
  numpy) over a drawn dim, on tie-rich inputs; gradient of the values;
* cumsum (inclusive, exclusive) and shift (offsets of 0, within a block, whole blocks, several
  blocks, negative, beyond the dim; wrap or zero fill) along a drawn, often split, dim; a shift
  communicates by collective-permutes only.

Unit tests pin down docs/design.md's table case by case.
"""

import harness
import numpy as np
import pytest
import reference as R
import strategies as S
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

import meshdsl as md

D = md.Dim


def ints(rng, spec, low, high):
    """An int32 md tensor of dims ``spec`` with values in ``[low, high)``."""
    ds = harness.dims(spec)
    return harness.from_numpy(rng.integers(low, high, [d.size for d in ds]).astype(np.int32), ds)


def summary(fn, mesh, layout, *args):
    return md.explain(fn, mesh, layout, *args).summary()


# ---- one_hot and range ----


@settings(max_examples=S.examples(10))
@given(mesh=S.meshes(), pool=S.dim_pool(3), classes=S.sizes(), data=st.data(), rng=S.rngs())
def test_one_hot_and_range(mesh, pool, classes, data, rng):
    shape = data.draw(S.sub_shape(pool, max_rank=2), label="indices dims")
    layout = data.draw(S.layouts_splitting(mesh, {**pool, "classes": classes}, "classes"), label="layout")
    c = D("classes", classes)

    def fn(i1, i2, i3):
        return {
            "one_hot": md.one_hot(i1, c),
            "one_hot on/off": md.one_hot(i2, c, on_value=2.5, off_value=-1.0),
            "one_hot int32": md.one_hot(i3, c, dtype=np.int32),
            "range": md.range(c),
            "range float": md.range(c, dtype=np.float32),
        }

    def ref(i1, i2, i3):
        return {
            "one_hot": R.one_hot(i1, "classes", classes),
            "one_hot on/off": R.one_hot(i2, "classes", classes, 2.5, -1.0),
            "one_hot int32": R.one_hot(i3, "classes", classes, dtype=np.int32),
            "range": R.arange("classes", classes),
            "range float": R.arange("classes", classes, np.float32),
        }

    args = [ints(rng, shape, -2, classes + 2) for _ in range(3)]
    assume(harness.check(fn, args, ref, mesh, layout, backends=data.draw(S.backends(), label="backends")))
    assert summary(fn, mesh, layout, *args) == {}
    event(f"classes split over {len(layout.rules.get('classes', ()))} axes")


@pytest.mark.parametrize(
    ("mesh", "layout"),
    [
        ("x8", {"classes": "x"}),
        ("data4_model2", {"classes": ("model", "data")}),
        ("data4_model2", {"classes": "model", "batch": "data"}),
        ("a2_b2_c2", {"classes": ("c", "a"), "batch": "b"}),
    ],
)
def test_one_hot_and_range_into_split_dim_communicate_nothing(mesh, layout):
    m = harness.mesh(mesh)
    c = D("classes", 16)
    idx = harness.from_numpy(np.array([0, 3, 15, 16, -1, 7, 8, 9], np.int32), [D("batch", 8)])

    def fn(i):
        return md.one_hot(i, c), md.range(c)

    assert harness.check(fn, [idx], lambda i: (R.one_hot(i, "classes", 16), R.arange("classes", 16)), m, layout)
    assert summary(fn, m, layout, idx) == {}


# ---- gather ----


@settings(max_examples=S.examples(15))
@given(mesh=S.meshes(), pool=S.dim_pool(4), vocab=S.sizes(), data=st.data(), rng=S.rngs())
def test_gather(mesh, pool, vocab, data, rng):
    names = [n for n in pool if n != "vocab"]  # the pool may hold the name vocab too
    rest = data.draw(st.lists(st.sampled_from(names), max_size=2, unique=True), label="weight dims")
    at = data.draw(st.integers(0, len(rest)), label="vocab position")
    w_dims = [(n, pool[n]) for n in rest]
    w_dims.insert(at, ("vocab", vocab))
    free = [n for n in names if n not in rest]
    idx_names = data.draw(
        st.permutations(free).flatmap(lambda p: st.integers(1, min(2, len(p))).map(lambda k: p[:k])), label="index dims"
    )
    idx_dims = {n: pool[n] for n in idx_names}
    # risk: some dims take axes another dim holds, e.g. an index dim and vocab (never in one
    # tensor, so legal): the gather must pick which keeps the axis.
    layout = data.draw(S.layouts_splitting(mesh, {**pool, "vocab": vocab}, "vocab", risk=0.3), label="layout")

    def fn(w, i, w1, i1, w2):
        return {
            "gather": md.gather(w, i, "vocab"),
            "sum of two gathers": md.gather(w1, i1, "vocab") + 0.5 * md.gather(w2, i1, "vocab"),
        }

    def ref(w, i, w1, i1, w2):
        return {
            "gather": R.gather(w, i, "vocab"),
            "sum of two gathers": R.gather(w1, i1, "vocab") + 0.5 * R.gather(w2, i1, "vocab"),
        }

    args = [
        harness.rand(rng, w_dims),
        ints(rng, idx_dims, -3, vocab + 3),
        harness.rand(rng, w_dims),
        ints(rng, idx_dims, -3, vocab + 3),
        harness.rand(rng, w_dims),
    ]
    assume(harness.check(fn, args, ref, mesh, layout, backends=data.draw(S.backends(), label="backends")))
    clash = set(layout.rules.get("vocab", ())) & {a for n in idx_names for a in layout.rules.get(n, ())}
    event(
        "vocab split" + (", clashing with an index dim" if clash else "")
        if layout.rules.get("vocab")
        else "vocab unsplit"
    )


GATHER_INDICES = np.array([0, 5, 15, 16, -1, -16, 100, 8], np.int32)
"""In range, at both ends of the blocks, and out of range: 16 (one past), -1, -16 (negative), 100."""


@pytest.mark.parametrize(
    ("mesh", "layout", "axes"),
    [
        ("data4_model2", {"vocab": "model"}, ("model",)),
        ("data4_model2", {"vocab": ("data", "model")}, ("data", "model")),
        ("x8", {"vocab": "x"}, ("x",)),
        ("a2_b2_c2", {"vocab": ("b", "c"), "batch": "a"}, ("b", "c")),
    ],
)
def test_vocab_parallel_gather_is_a_pending_psum(mesh, layout, axes):
    # Each device looks up the indices in its block of vocab and zeros the rest: a partial sum
    # over vocab's axes, still pending on the result (added by one all-reduce at the end).
    m = harness.mesh(mesh)
    rng = np.random.default_rng(0)
    w = harness.rand(rng, {"vocab": 16, "d": 4})
    idx = harness.from_numpy(GATHER_INDICES, [D("batch", 8)])
    pending = []

    def fn(w, i):
        out = md.gather(w, i, "vocab")
        pending.append(out.pending)
        return out

    got = md.compile(fn, m, layout)(w, idx).numpy()
    assert pending[-1] == axes  # traced once for shapes (on global arrays), then in shard_map
    want = np.where(
        ((GATHER_INDICES >= 0) & (GATHER_INDICES < 16))[:, None], w.numpy()[np.clip(GATHER_INDICES, 0, 15)], 0
    )
    np.testing.assert_array_equal(got, want)  # a sum of one value and zeros: exact
    assert np.all(got[[3, 4, 5, 6]] == 0)
    assert harness.check(fn, [w, idx], lambda w, i: R.gather(w, i, "vocab"), m, layout)
    s = summary(fn, m, layout, w, idx)
    assert list(s) == ["all-reduce"] and s["all-reduce"]["count"] == 1


def test_two_gathers_added_cost_one_all_reduce():
    m, layout = harness.mesh("data4_model2"), {"vocab": "model", "batch": "data"}
    rng = np.random.default_rng(1)
    w1, w2 = harness.rand(rng, {"vocab": 16, "d": 4}), harness.rand(rng, {"vocab": 16, "d": 4})
    idx = harness.from_numpy(GATHER_INDICES, [D("batch", 8)])

    def fn(w1, w2, i):
        return md.gather(w1, i, "vocab") - md.gather(w2, i, "vocab") * 2.0

    assert harness.check(
        fn, [w1, w2, idx], lambda w1, w2, i: R.gather(w1, i, "vocab") - R.gather(w2, i, "vocab") * 2.0, m, layout
    )
    # one all-reduce over model of the local [batch=2, d=4] result: 2 * 1/2 * 32 bytes.
    assert summary(fn, m, layout, w1, w2, idx) == {"all-reduce": {"count": 1, "bytes": 32.0}}


@pytest.mark.parametrize(
    ("mesh", "layout"),
    [
        # indices' batch and weights' vocab both split over model: one must give the axis up.
        ("data4_model2", {"vocab": "model", "batch": "model"}),
        ("data4_model2", {"vocab": "model", "batch": ("model", "data")}),
        ("x8", {"vocab": "x", "batch": "x"}),
        # a pair of axes in both orders, plus d on the third axis.
        ("a2_b2_c2", {"vocab": ("a", "b"), "batch": ("b", "a"), "d": "c"}),
        # two index dims each clash with one of vocab's two axes.
        ("a2_b2_c2", {"vocab": ("a", "c"), "seq": "c", "batch": "a", "d": "b"}),
    ],
)
def test_gather_clashing_splits(mesh, layout):
    m = harness.mesh(mesh)
    rng = np.random.default_rng(2)
    w = harness.rand(rng, {"vocab": 16, "d": 4})
    idx = ints(rng, {"batch": 8, "seq": 2}, -2, 18)
    fn = lambda w, i: md.gather(w, i, "vocab")  # noqa: E731
    assert harness.check(fn, [w, idx], lambda w, i: R.gather(w, i, "vocab"), m, layout)


def test_gather_clash_keeps_the_axis_where_it_costs_least():
    # vocab and batch both on x (8 devices). Weights f32[vocab=64, d=8] (2 KiB) are large, the
    # indices int32[batch=8] small: keeping x on vocab gathers the indices (7/8 * 32 B) and
    # reduce-scatters the partial [batch=8, d=8] result into batch (7/8 * 256 B); keeping it on
    # batch would gather the weights (7/8 * 2048 B).
    m, layout = harness.mesh("x8"), {"vocab": "x", "batch": "x"}
    rng = np.random.default_rng(3)
    w, idx = harness.rand(rng, {"vocab": 64, "d": 8}), ints(rng, {"batch": 8}, -1, 65)
    fn = lambda w, i: md.gather(w, i, "vocab")  # noqa: E731
    assert harness.check(fn, [w, idx], lambda w, i: R.gather(w, i, "vocab"), m, layout)
    assert summary(fn, m, layout, w, idx) == {
        "all-gather": {"count": 1, "bytes": 28.0},
        "reduce-scatter": {"count": 1, "bytes": 224.0},
    }


# ---- one name for two dims: an error under every layout, never a wrong number ----

NAME_CLASH_LAYOUTS = ["", "H:x", "H:(x y); d:z", "d:x"]


def _name_clash_cases():
    """(case, md function, its arguments, the name the message must give)."""
    rng = np.random.default_rng(4)
    w = harness.from_numpy(np.arange(8, dtype=np.float32), [D("H", 8)])
    wd = harness.rand(rng, {"H": 8, "d": 4})
    x = harness.rand(rng, {"d": 4, "H": 8})
    return [
        # the indices' H is another dim than the weights' H (spmd split both over x: [0, 1, 0, 1])
        (
            "gather, index dim named like the gathered dim",
            lambda w, i: md.gather(w, i, "H"),
            (w, ints(rng, {"H": 4}, 0, 8)),
            "H",
        ),
        ("gather, same sizes", lambda w, i: md.gather(w, i, "H"), (w, ints(rng, {"H": 8}, 0, 8)), "H"),
        (
            "gather, index dim named like a kept weights dim",
            lambda w, i: md.gather(w, i, "H"),
            (wd, ints(rng, {"d": 4}, 0, 8)),
            "d",
        ),
        (
            "take_along, index dim named like the looked-up dim",
            lambda x, i: md.take_along(x, i, "H"),
            (x, ints(rng, {"d": 4, "H": 8}, 0, 8)),
            "H",
        ),
        ("take_along, index dim x lacks", lambda x, i: md.take_along(x, i, "H"), (x, ints(rng, {"e": 2}, 0, 8)), "e"),
        ("one_hot into a dim the indices have", lambda i: md.one_hot(i, D("H", 8)), (ints(rng, {"H": 8}, 0, 8),), "H"),
        ("top_k, k_dim named like a kept dim", lambda x: md.top_k(x, "H", D("d", 2))[0], (x,), "d"),
    ]


@pytest.mark.parametrize("backend", ["eager", *harness.BACKENDS])
@pytest.mark.parametrize("layout", NAME_CLASH_LAYOUTS)
def test_one_name_for_two_dims_is_a_shape_error(backend, layout):
    mesh = md.Mesh({"x": 2, "y": 2, "z": 2})
    for case, fn, args, name in _name_clash_cases():
        with pytest.raises(md.ShapeError) as info:
            (fn if backend == "eager" else md.compile(fn, mesh, layout, backend=backend))(*args)
        message = str(info.value)
        op = case.split(",")[0].split()[0]
        assert message.startswith(f"{op}:") and "\n" not in message, f"{case}: not one line naming the op: {message}"
        assert f"{name}=" in message or f"{name!r}" in message or f" {name} " in message, (
            f"{case}: the message does not name {name}: {message}"
        )


@pytest.mark.parametrize(
    "layout", [{}, {"vocab": "x"}, {"vocab": ("x", "y"), "batch": "z"}, {"batch": "x", "vocab": "y"}]
)
def test_top_k_with_k_dim_named_like_the_reduced_dim(layout):
    # The result's vocab (size k) replaces the reduced vocab: a new dim under the same rule.
    rng = np.random.default_rng(5)
    x = harness.rand(rng, {"batch": 4, "vocab": 16})
    fn = lambda x: md.top_k(x, "vocab", D("vocab", 4))  # noqa: E731
    assert harness.check(fn, [x], lambda x: R.top_k(x, "vocab", "vocab", 4), md.Mesh({"x": 2, "y": 2, "z": 2}), layout)


# ---- top_k and argmax ----


@settings(max_examples=S.examples(12))
@given(mesh=S.meshes(), pool=S.dim_pool(3), data=st.data(), rng=S.rngs())
def test_top_k_and_argmax(mesh, pool, data, rng):
    shape = data.draw(S.sub_shape(pool, max_rank=3), label="x dims")
    dim = data.draw(st.sampled_from(list(shape)), label="reduced dim")
    k = data.draw(st.integers(1, min(shape[dim], 5)), label="k")
    kind = data.draw(st.sampled_from(["int", "normal"]), label="values")  # int: many ties
    layout = data.draw(S.layouts_splitting(mesh, {**pool, "k": k}, dim), label="layout")
    kd = D("k", k)

    def fn(x, y):
        values, indices = md.top_k(x, dim, kd)
        return {"values": values, "indices": indices, "argmax": md.argmax(y, dim)}

    def ref(x, y):
        values, indices = R.top_k(x, dim, "k", k)
        return {"values": values, "indices": indices, "argmax": R.argmax(y, dim)}

    args = [harness.rand(rng, shape, kind), harness.rand(rng, shape, kind)]
    args = harness.sprinkle(rng, args, data.draw(S.specials(), label="NaN/inf/-0.0 share"))
    assume(harness.check(fn, args, ref, mesh, layout, backends=data.draw(S.backends(), label="backends")))
    g = S.group_size(mesh, layout, dim)
    event(
        "reduced dim unsplit" if g == 1 else "k within the block" if shape[dim] // g >= k else "k larger than a block"
    )


def test_top_k_over_split_dim_two_all_gathers_ties_to_lower_index():
    # vocab=16 over x (blocks of 2). Row 0 ties 3.0 at 1, 4, 9 (devices 0, 2, 4): top 2 are
    # indices 1, 4. Row 1 all equal: 0, 1, 2. Local top 3 > block of 2: gathered whole first.
    m, layout = harness.mesh("x8"), {"vocab": "x"}
    a = np.zeros((2, 16), np.float32)
    a[0, [1, 4, 9]] = 3.0
    a[0, 12] = -1.0
    x = harness.from_numpy(a, [D("batch", 2), D("vocab", 16)])

    def top2(x):
        return md.top_k(x, "vocab", D("k", 2))

    values, indices = md.compile(top2, m, layout)(x)
    np.testing.assert_array_equal(indices.numpy(), [[1, 4], [0, 1]])
    np.testing.assert_array_equal(values.numpy(), [[3, 3], [0, 0]])
    assert harness.check(top2, [x], lambda x: R.top_k(x, "vocab", "k", 2), m, layout)
    # two all-gathers (values, indices) of the candidates, f32 / int32 [batch=2, 8 devices x 2]
    # (128 B): 7/8 * 128 B each.
    assert summary(top2, m, layout, x) == {"all-gather": {"count": 2, "bytes": 224.0}}

    def top3(x):
        return md.top_k(x, "vocab", D("k", 3))

    assert harness.check(top3, [x], lambda x: R.top_k(x, "vocab", "k", 3), m, layout)
    assert list(summary(top3, m, layout, x)) == ["all-gather"]


@pytest.mark.parametrize(
    ("mesh", "layout"),
    [
        ("x8", {"vocab": "x"}),
        ("data4_model2", {"vocab": ("model", "data")}),
        ("data4_model2", {"vocab": "data", "batch": "model"}),
        ("a2_b2_c2", {"vocab": ("c", "b"), "batch": "a"}),
    ],
)
def test_argmax_over_split_dim_ties_to_lowest_index(mesh, layout):
    # Ties spread over devices: row 0's maximum 2 at 13 and 6 (-> 6); row 1 all equal (-> 0);
    # row 2's at the last entry only (-> 15).
    m = harness.mesh(mesh)
    a = np.zeros((2, 16), np.float32)
    a[0, [13, 6]] = 2.0
    a[1] = -3.0
    b = np.zeros((16,), np.float32)
    b[15] = 1.0
    c = np.arange(16, dtype=np.float32)[::-1].copy()  # row 3: distinct values, maximum at 0
    x = harness.from_numpy(np.concatenate([a, b[None], c[None]]), [D("batch", 4), D("vocab", 16)])
    fn = lambda x: md.argmax(x, "vocab")  # noqa: E731
    got = md.compile(fn, m, layout)(x).numpy()
    np.testing.assert_array_equal(got, [6, 0, 15, 0])
    assert harness.check(fn, [x], lambda x: R.argmax(x, "vocab"), m, layout)
    s = summary(fn, m, layout, x)
    assert list(s) == ["all-reduce"] and s["all-reduce"]["count"] == 2  # pmax of values, pmin of indices


# ---- cumsum and shift ----


def shift_offsets(n, block):
    """Offsets that exercise every case of a split shift: none, within a block, whole blocks,
    more than a block, negative, the whole dim and beyond."""
    return sorted(
        {0, 1, block - 1, block, block + 1, 2 * block, -1, -block, -block - 1, n - 1, n, n + 3, -n, -n - 2, 3 * n + 1}
    )


@settings(max_examples=S.examples(15))
@given(mesh=S.meshes(), pool=S.dim_pool(3), data=st.data(), rng=S.rngs())
def test_cumsum_and_shift(mesh, pool, data, rng):
    shape = data.draw(S.sub_shape(pool, max_rank=3), label="x dims")
    dim = data.draw(st.sampled_from(list(shape)), label="dim")
    # The shifted dim's axes may come in any order (a pair out of the mesh's order once moved
    # blocks to the wrong devices: test_shift_over_axes_out_of_mesh_order).
    layout = data.draw(S.layouts_splitting(mesh, pool, dim), label="layout")
    n = shape[dim]
    block = max(n // S.group_size(mesh, layout, dim), 1)
    offsets = data.draw(
        st.lists(st.sampled_from(shift_offsets(n, block)), min_size=2, max_size=3, unique=True), label="offsets"
    )
    wraps = [data.draw(st.booleans(), label=f"wrap {o}") for o in offsets]

    def shifts(*xs):
        return {f"shift {o} wrap={w}": md.shift(x, o, dim, wrap=w) for x, o, w in zip(xs, offsets, wraps)}

    def fn(c, e, *xs):
        return {"cumsum": md.cumsum(c, dim), "exclusive": md.cumsum(e, dim, exclusive=True), **shifts(*xs)}

    def ref(c, e, *xs):
        out = {"cumsum": R.cumsum(c, dim), "exclusive": R.cumsum(e, dim, exclusive=True)}
        return {**out, **{f"shift {o} wrap={w}": R.shift(x, o, dim, w) for x, o, w in zip(xs, offsets, wraps)}}

    args = [harness.rand(rng, shape) for _ in range(2 + len(offsets))]
    args = harness.sprinkle(rng, args, data.draw(S.specials(), label="NaN/inf/-0.0 share"))
    assume(harness.check(fn, args, ref, mesh, layout, backends=data.draw(S.backends(), label="backends")))
    moved = summary(shifts, mesh, layout, *args[2:])
    assert set(moved) <= {"collective-permute"}, moved
    assert moved.get("collective-permute", {"count": 0})["count"] <= 2 * len(offsets)
    event("dim split" if block < n else "dim unsplit")


@pytest.mark.parametrize(
    ("mesh", "layout"),
    [
        ("x8", {"n": "x"}),
        ("data4_model2", {"n": ("data", "model")}),
        ("data4_model2", {"n": "data", "b": "model"}),
        ("a2_b2_c2", {"n": ("c", "a"), "b": "b"}),
        ("a2_b2_c2", {"b": ("a", "b", "c")}),
    ],
)
def test_cumsum_along_split_dim_is_one_all_gather(mesh, layout):
    m = harness.mesh(mesh)
    rng = np.random.default_rng(4)
    x, y = harness.rand(rng, {"b": 8, "n": 16}), harness.rand(rng, {"b": 8, "n": 16})

    def fn(x, y):
        return md.cumsum(x, "n"), md.cumsum(y, "n", exclusive=True)

    assert harness.check(fn, [x, y], lambda x, y: (R.cumsum(x, "n"), R.cumsum(y, "n", True)), m, layout)
    want = {} if "n" not in layout else {"all-gather": 2}  # one per cumsum: the block totals
    assert {k: v["count"] for k, v in summary(fn, m, layout, x, y).items()} == want


# n=16 over x (8 devices): blocks of 2. (offset, wrap, collective-permutes). A block's rows that
# stay within a device's range move by whole blocks (one permute unless that is 0 blocks); rows
# that spill over the block boundary take a second one; shifts out of the dim need none.
SHIFTS = [
    (0, False, 0),
    (0, True, 0),
    (1, False, 1),
    (1, True, 1),  # within a block: the staying rows do not move, the spill does
    (2, False, 1),
    (2, True, 1),  # exactly one block
    (3, False, 2),
    (3, True, 2),  # one block and a spill
    (5, True, 2),
    (4, False, 1),  # several blocks
    (-1, False, 1),
    (-2, True, 1),
    (-3, False, 2),
    (-5, True, 2),
    (15, False, 1),
    (15, True, 1),  # the last row only (wrap: one step back round the ring)
    (16, False, 0),
    (16, True, 0),
    (-16, True, 0),  # the whole dim: zeros, or the identity
    (17, False, 0),
    (17, True, 1),
    (-17, True, 1),
    (100, False, 0),
    (100, True, 1),
    (-100, False, 0),
]


def test_shift_along_split_dim_values():
    # Every offset of SHIFTS in one program (one input each): values against np.roll (wrap) or
    # np.roll with the wrapped-in entries zeroed, and the full harness check.
    m, layout = harness.mesh("x8"), {"n": "x"}
    rng = np.random.default_rng(5)
    xs = [harness.rand(rng, {"b": 2, "n": 16}) for _ in SHIFTS]

    def fn(*ts):
        return [md.shift(t, o, "n", wrap=w) for t, (o, w, _) in zip(ts, SHIFTS)]

    got = md.compile(fn, m, layout)(*xs)
    for g, x, (offset, wrap, _) in zip(got, xs, SHIFTS):
        want = np.roll(x.numpy(), offset, axis=1)
        if not wrap:  # zero fill: out[i] = x[i - offset] where that is inside
            want[:, ~((np.arange(16) - offset >= 0) & (np.arange(16) - offset < 16))] = 0
        np.testing.assert_array_equal(g.numpy(), want, err_msg=f"offset {offset} wrap {wrap}")
    assert harness.check(fn, xs, lambda *ts: [R.shift(t, o, "n", w) for t, (o, w, _) in zip(ts, SHIFTS)], m, layout)


@pytest.mark.parametrize(
    ("offset", "wrap", "permutes"), SHIFTS, ids=[f"{o}{'-wrap' if w else ''}" for o, w, _ in SHIFTS]
)
def test_shift_along_split_dim_collective_permutes(offset, wrap, permutes):
    # md.explain equals the compiled HLO for all of these at once (the test above); here each
    # shift's own count: collective-permutes only, as many as the table says.
    m, layout = harness.mesh("x8"), {"n": "x"}
    x = harness.rand(np.random.default_rng(5), {"b": 2, "n": 16})
    s = summary(lambda x: md.shift(x, offset, "n", wrap=wrap), m, layout, x)
    assert set(s) <= {"collective-permute"}
    assert s.get("collective-permute", {"count": 0})["count"] == permutes


@pytest.mark.parametrize(
    ("mesh", "layout"),
    [
        ("data4_model2", {"n": ("data", "model")}),
        ("data4_model2", {"n": "data", "b": "model"}),
        ("a2_b2_c2", {"n": ("a", "c"), "b": "b"}),
        ("a2_b2_c2", {"n": ("a", "b", "c")}),
        ("a2_b2_c2", {"b": "a"}),
        # axes out of the mesh's order
        ("data4_model2", {"n": ("model", "data")}),
        ("a2_b2_c2", {"n": ("c", "a"), "b": "b"}),
        ("a2_b2_c2", {"n": ("b", "c", "a")}),
    ],
)
def test_shift_over_axis_tuples(mesh, layout):
    m = harness.mesh(mesh)
    cases = [(o, w) for w in (False, True) for o in (1, -3, 4, 13)]
    x = [harness.rand(np.random.default_rng(6 + i), {"b": 2, "n": 16}) for i in range(len(cases))]

    def fn(*xs):
        return tuple(md.shift(t, o, "n", wrap=w) for t, (o, w) in zip(xs, cases))

    assert harness.check(fn, x, lambda *xs: tuple(R.shift(t, o, "n", w) for t, (o, w) in zip(xs, cases)), m, layout)
    s = summary(fn, m, layout, *x)
    assert set(s) <= {"collective-permute"}
    assert ("collective-permute" in s) == ("n" in layout)


def test_shift_over_axes_out_of_mesh_order():
    # A wrap shift by one block of 2, n split over (model, data): lax.ppermute numbers the
    # devices of an axis tuple in mesh order, the layout major to minor as written.
    m = harness.mesh("data4_model2")
    x = harness.from_numpy(np.arange(16, dtype=np.float32), [D("n", 16)])
    got = md.compile(lambda x: md.shift(x, 2, "n", wrap=True), m, {"n": ("model", "data")})(x).numpy()
    np.testing.assert_array_equal(got, np.roll(np.arange(16, dtype=np.float32), 2))


def test_index_op_errors():
    rng = np.random.default_rng(7)
    x = harness.rand(rng, {"b": 2, "n": 4})
    with pytest.raises(md.ShapeError):
        md.top_k(x, "n", D("k", 5))
    with pytest.raises(md.ShapeError):
        md.gather(x, x, "n")  # float indices
