"""md.einsum: contraction by dim name, its compute layout, and lazy partial sums.

The drawn tests contract drawn operands (2 or 3 inputs, dims from a shared pool, the output a
drawn subset in a drawn order, or the default: dims in exactly one input) under drawn layouts,
including layouts where two dims that never meet in one tensor share a mesh axis (so the
einsum must choose which keeps it), and run the full harness check. A second drawn test adds
einsums whose partial sums are still pending.

The unit tests pin the communication down by hand: two einsums added over a split contracted
dim cost one all-reduce, not two; a contraction whose result wants the contracted dim's axis
is a reduce-scatter; and the known md.explain bug with XLA's CSE.
"""

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as R
import strategies as S
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import meshdsl as md
from meshdsl.analysis import hlo


def out_arg(names, form, sizes):
    """The output dims as meshdsl accepts them: list of names, string, list of Dims or a Shape."""
    if form == "string":
        return " ".join(names)
    if form == "dims":
        return [md.Dim(n, sizes[n]) for n in names]
    if form == "shape":
        return md.Shape(md.Dim(n, sizes[n]) for n in names)
    return list(names)


def default_out(*shapes):
    """Dims that appear in exactly one operand, in order of first appearance (the documented default)."""
    names = [n for s in shapes for n in s]
    return [n for n in dict.fromkeys(names) if names.count(n) == 1]


@settings(max_examples=S.examples(20))
@given(mesh=S.meshes(), pool=S.dim_pool(5), data=st.data(), rng=S.rngs())
def test_einsum(mesh, pool, data, rng):
    xs = data.draw(S.sub_shape(pool), label="x dims")
    ys = data.draw(S.sub_shape(pool), label="y dims")
    zs = data.draw(S.sub_shape(pool, max_rank=2), label="z dims")
    union = list(dict.fromkeys([*xs, *ys]))
    out = data.draw(
        st.permutations(union).flatmap(lambda p: st.integers(0, min(3, len(p))).map(lambda k: p[:k])), label="out"
    )
    union3 = list(dict.fromkeys([*xs, *ys, *zs]))
    out3 = data.draw(
        st.permutations(union3).flatmap(lambda p: st.integers(0, min(3, len(p))).map(lambda k: p[:k])), label="out3"
    )
    form = data.draw(st.sampled_from(["names", "string", "dims", "shape"]), label="out form")
    layout = data.draw(S.layouts(mesh, pool, risk=0.3), label="layout")
    default = default_out(xs, ys)
    assume(len(default) <= 4)
    arg, arg3 = out_arg(out, form, pool), out_arg(out3, form, pool)

    def fn(x, y, x2, y2, x3, y3, z3):
        return {
            "einsum": md.einsum(x, y, out=arg),
            "default out": md.einsum(x2, y2),
            "three operands": md.einsum([x3, y3, z3], out=arg3),
        }

    def ref(x, y, x2, y2, x3, y3, z3):
        return {
            "einsum": R.einsum(out, x, y),
            "default out": R.einsum(default, x2, y2),
            "three operands": R.einsum(out3, x3, y3, z3),
        }

    args = [harness.rand(rng, d) for d in (xs, ys, xs, ys, xs, ys, zs)]
    assume(harness.check(fn, args, ref, mesh, layout, backends=data.draw(S.backends(), label="backends")))


@settings(max_examples=S.examples(20))
@given(mesh=S.meshes(), pool=S.dim_pool(4), data=st.data(), rng=S.rngs())
def test_einsum_partial_sums_added_lazily(mesh, pool, data, rng):
    # a.b + c.d - 2 (e.f) * w: the sums stay pending through +, - and * by a tensor or scalar
    # when the layouts allow (meshdsl decides); the values must be right either way.
    xs = data.draw(S.sub_shape(pool), label="x dims")
    ys = data.draw(S.sub_shape(pool), label="y dims")
    union = list(dict.fromkeys([*xs, *ys]))
    out = data.draw(
        st.permutations(union).flatmap(lambda p: st.integers(0, min(3, len(p))).map(lambda k: p[:k])), label="out"
    )
    ws = data.draw(st.permutations(out).flatmap(lambda p: st.integers(0, len(p)).map(lambda k: p[:k])), label="w dims")
    layout = data.draw(S.layouts(mesh, pool, risk=0.3), label="layout")

    def fn(a, b, c, d, e, f, w):
        return md.einsum(a, b, out=out) + md.einsum(c, d, out=out) - 2.0 * md.einsum(e, f, out=out) * w

    def ref(a, b, c, d, e, f, w):
        return R.einsum(out, a, b) + R.einsum(out, c, d) - 2.0 * R.einsum(out, e, f) * w

    args = [harness.rand(rng, d) for d in (xs, ys, xs, ys, xs, ys)] + [harness.rand(rng, {n: pool[n] for n in ws})]
    assume(harness.check(fn, args, ref, mesh, layout, backends=data.draw(S.backends(), label="backends")))


# ---- communication, by hand ----


def _inputs(seed, *specs):
    rng = np.random.default_rng(seed)
    return [harness.rand(rng, s) for s in specs]


@pytest.mark.parametrize(
    "layout",
    [
        {"d_model": "model"},
        {"d_model": "model", "batch": "data"},
        {"d_model": ("data", "model")},
    ],
)
def test_two_einsums_over_a_split_dim_cost_one_all_reduce(layout):
    # Both products contract d_model, split over the axes A; their partial sums are added
    # locally and reduced once: one all-reduce over A of the local [batch, d_ff] result.
    mesh = harness.mesh("data4_model2")
    a, b, c, d = _inputs(
        0,
        {"batch": 8, "d_model": 16},
        {"d_model": 16, "d_ff": 4},
        {"batch": 8, "d_model": 16},
        {"d_model": 16, "d_ff": 4},
    )

    def fn(a, b, c, d):
        return md.einsum(a, b, out=["batch", "d_ff"]) + md.einsum(c, d, out=["batch", "d_ff"])

    def ref(a, b, c, d):
        return R.einsum("batch d_ff", a, b) + R.einsum("batch d_ff", c, d)

    assert harness.check(fn, [a, b, c, d], ref, mesh, layout)
    summary = harness.assert_explain_matches_hlo(fn, mesh, layout, [a, b, c, d])
    axes = layout["d_model"] if isinstance(layout["d_model"], tuple) else (layout["d_model"],)
    n = int(np.prod([mesh.axis_sizes[x] for x in axes]))
    local = 8 // (4 if "batch" in layout else 1) * 4 * 4  # local [batch, d_ff] f32 result
    assert summary == {"all-reduce": {"count": 1, "bytes": 2 * (n - 1) / n * local}}


def test_partial_sums_are_added_before_a_nonlinear_op_needs_them():
    # relu needs the value: the pending sum is reduced first (one all-reduce), and the result
    # is right.
    mesh, layout = harness.mesh("data4_model2"), {"d_model": "model"}
    a, b = _inputs(1, {"batch": 8, "d_model": 16}, {"d_model": 16})

    def fn(a, b):
        return md.relu(md.einsum(a, b, out=["batch"]))

    assert harness.check(fn, [a, b], lambda a, b: R.relu(R.einsum("batch", a, b)), mesh, layout)
    assert harness.assert_explain_matches_hlo(fn, mesh, layout, [a, b])["all-reduce"]["count"] == 1


def test_a_split_dim_of_one_operand_alone_is_summed_before_the_product():
    # x[d_model] * y[batch] -> [batch] with d_model and batch both split over model: d_model is in
    # x alone, so x is summed over it first (as jnp.einsum does on the global array), one all-reduce
    # of a scalar (2 * 1/2 * 4 B), and the product needs nothing more. Multiplying first would move
    # the partial products (a gather of y and a reduce-scatter into batch, 16 B each) and get NaN
    # where an inf meets a partial sum of 0.
    mesh, layout = harness.mesh("data4_model2"), {"d_model": "model", "batch": "model"}
    x, y = _inputs(2, {"d_model": 64}, {"batch": 8})

    def fn(x, y):
        return md.einsum(x, y, out=["batch"])

    assert harness.check(fn, [x, y], lambda x, y: R.einsum("batch", x, y), mesh, layout)
    assert harness.assert_explain_matches_hlo(fn, mesh, layout, [x, y]) == {"all-reduce": {"count": 1, "bytes": 4.0}}


@pytest.mark.parametrize("three", [False, True])
def test_a_loop_invariant_sum_runs_once_as_xla_hoists_it(three):
    """In a scan body, einsum(u, w[vocab d_model]) with vocab split sums the loop constant w over
    vocab first (and v over d_ff, split too, in the three-operand einsum): each all-reduce reads a
    constant alone, and XLA moves it before the loop, where it runs once, not once per step
    (md.explain's walker hoists it too: ``jaxpr_walk.loop_invariant``)."""
    rng = np.random.default_rng(0)
    xs = harness.rand(rng, {"n": 3, "d_model": 4})
    w = harness.rand(rng, {"vocab": 8, "d_model": 4})
    v = harness.rand(rng, {"d_ff": 8})

    def fn(xs, w, v):
        def body(c, x):
            u = c + x * 0.5
            e = md.einsum(u, w, v, out=["d_model"]) if three else md.einsum(u, w, out=["d_model"])
            return md.tanh(e), e

        return md.scan(body, md.zeros([md.Dim("d_model", 4)]), xs, "n")

    layout = "vocab:model; d_ff:data"
    summary = harness.assert_explain_matches_hlo(fn, harness.mesh("data2_model4"), layout, [xs, w, v])
    assert summary["all-reduce"]["count"] == (2 if three else 1), summary


def test_clash_over_a_pair_of_axes():
    # d_model split over (a, b) and batch over (b, a): x[d_model, seq] and y[seq, batch] are
    # legal, and the einsum must give both axes to one of the two dims.
    mesh, layout = harness.mesh("a2_b2_c2"), {"d_model": ("a", "b"), "batch": ("b", "a"), "seq": "c"}
    x, y = _inputs(3, {"d_model": 16, "seq": 4}, {"seq": 4, "batch": 8})

    def fn(x, y):
        return md.einsum(x, y, out=["batch"])

    assert harness.check(fn, [x, y], lambda x, y: R.einsum("batch", x, y), mesh, layout)


def test_einsum_output_dims_in_requested_order():
    x, y = _inputs(4, {"a": 2, "b": 4}, {"b": 4, "c": 6})
    out = md.einsum(x, y, out="c a")
    assert out.names == ("c", "a")
    np.testing.assert_allclose(out.numpy(), np.einsum("ab,bc->ca", x.numpy(), y.numpy()), rtol=1e-5)


# ---- repeated identical collectives ----


def _cse_case():
    # grad of sum(((x + y) + x) * c) for x[b] replicated and y, c split over d: the two
    # broadcasts of x transpose to two all-reduces of one and the same value.
    mesh, layout = harness.mesh("x8"), md.Layout({"d": "x"})
    x, y, c = _inputs(5, {"b": 2}, {"b": 2, "d": 8}, {"b": 2, "d": 8})

    def grad(x, y, c):
        return jax.grad(lambda x: md.reduce_sum(((x + y) + x) * c).array)(x)

    return grad, mesh, layout, (x, y, c)


def test_explain_counts_a_repeated_collective_once_as_xla_runs_it():
    # The traced program all-reduces the same f32[2] twice; XLA's CSE runs it once (2 * 7/8 * 8
    # = 14 bytes over 8 devices), and md.explain merges the repeat as well.
    grad, mesh, layout, args = _cse_case()
    predicted = md.explain(grad, mesh, layout, *args).summary()
    assert predicted == {"all-reduce": {"count": 1, "bytes": 14.0}}
    assert hlo.summary(md.compile(grad, mesh, layout).lower(*args).compile().as_text()) == predicted
    np.testing.assert_allclose(
        md.compile(grad, mesh, layout)(*args).numpy(), 2 * args[2].numpy().sum(axis=1), rtol=1e-5
    )


@pytest.mark.parametrize("layout", ["heads:model", "seq:data; heads:model"])
def test_a_split_lone_dim_keeps_the_infinities_of_jnp(layout):
    """sum over seq, batch, heads of x[seq, batch] * w[d_model, heads]: jnp.einsum sums each operand's
    lone dims first, inf * (0 + 1 + 1 + 1) = inf; summing partial products over split heads gives
    inf * 0 + inf * 3 = NaN under spmd before the fix (issue 31: a layout changed a number)."""
    x = np.ones((4, 8), np.float32)
    x[1, 3] = np.inf
    w = np.ones((2, 4), np.float32)
    w[0, 1] = 0.0
    want = np.asarray(jnp.einsum("sb,dh->d", x, w))
    assert want.tolist() == [np.inf, np.inf]
    xt = harness.from_numpy(x, harness.dims({"seq": 4, "batch": 8}))
    wt = harness.from_numpy(w, harness.dims({"d_model": 2, "heads": 4}))
    for backend in harness.BACKENDS:
        got = md.compile(
            lambda a, b: md.einsum(a, b, out=["d_model"]), harness.mesh("data2_model4"), layout, backend=backend
        )(xt, wt)
        np.testing.assert_array_equal(got.numpy(), want, err_msg=f"{backend} {layout}")


def test_three_operands_contract_as_jnp_under_a_split():
    """einsum(h[b heads s], w[d s], v[s heads b]) -> [s b d] with an inf in w: jnp contracts h with v
    over heads first, then multiplies by w (-inf); with heads split over 8 devices spmd multiplies
    each device's partial sum by w and added after, before the fix (NaN where the partials' signs differ)."""
    rng = np.random.default_rng(0)
    h = rng.standard_normal((2, 8, 2)).astype(np.float32)
    w = rng.standard_normal((2, 2)).astype(np.float32)
    w[rng.integers(2), rng.integers(2)] = np.inf
    v = rng.standard_normal((2, 8, 2)).astype(np.float32)
    want = np.asarray(jnp.einsum("bhs,ds,shb->sbd", h, w, v))
    args = [
        harness.from_numpy(h, harness.dims({"batch": 2, "heads": 8, "seq": 2})),
        harness.from_numpy(w, harness.dims({"d_model": 2, "seq": 2})),
        harness.from_numpy(v, harness.dims({"seq": 2, "heads": 8, "batch": 2})),
    ]
    compiled = md.compile(
        lambda *t: md.einsum(*t, out=["seq", "batch", "d_model"]), harness.mesh("a2_b2_c2"), "heads:(b, c, a)"
    )
    harness.assert_values_close(compiled(*args).numpy(), want, what="spmd 3-operand einsum", nonfinite=True)
