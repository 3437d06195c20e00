"""Reductions (reduce_sum/mean/max/min) and the softmax family (logsumexp, softmax, log_softmax).

The drawn test reduces drawn dims of a drawn tensor under a drawn layout and runs the full
harness check (values, gradients, shardings, md.explain == HLO). The unit tests pin down the
communication by hand: a reduction over a split dim costs one all-reduce over that dim's axes
(bytes from the ring formula on the local result), one over an unsplit dim costs nothing, and
the softmax family over a split dim costs one max and one sum all-reduce; and the gradient of
reduce_max is the one-hot of the argmax.
"""

import functools
import operator

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

MD_REDUCE = {"sum": md.reduce_sum, "mean": md.reduce_mean, "max": md.reduce_max, "min": md.reduce_min}


def dims_arg(names, form, shape):
    """The same dims passed as meshdsl accepts them: a list of names, a string, or md.Dim objects."""
    if form == "string":
        return " ".join(names)
    if form == "dims":
        return [md.Dim(n, shape[n]) for n in names]
    return list(names)


def _cases(arg, names):
    """(name, md function, reference) for each result of the drawn test; each takes one input but "sum + sum"."""
    cases = [
        (kind, lambda x, op=op: op(x, arg), lambda x, kind=kind: R.reduce(kind, x, names))
        for kind, op in MD_REDUCE.items()
    ]
    return cases + [
        ("sum all", lambda x: md.reduce_sum(x), lambda x: R.reduce("sum", x)),
        ("max all", lambda x: md.reduce_max(x), lambda x: R.reduce("max", x)),
        # Two partial sums added before the collective.
        (
            "sum + sum",
            lambda x, y: md.reduce_sum(x, arg) + md.reduce_sum(y, arg),
            lambda x, y: R.reduce("sum", x, names) + R.reduce("sum", y, names),
        ),
        ("logsumexp", lambda x: md.logsumexp(x, arg), lambda x: R.logsumexp(x, names)),
        ("softmax", lambda x: md.softmax(x, arg), lambda x: R.softmax(x, names)),
        ("log_softmax", lambda x: md.log_softmax(x, arg), lambda x: R.log_softmax(x, names)),
    ]


@settings(max_examples=S.examples(15))
@given(mesh=S.meshes(), pool=S.dim_pool(3), data=st.data(), rng=S.rngs())
def test_reductions(mesh, pool, data, rng):
    # Every result gets inputs of its own: the same reduction of one tensor computed twice is
    # one collective after XLA's CSE, which md.explain counts twice (a known bug, see
    # test_einsum.py), so sharing inputs would hide the exact comparison behind it.
    shape = data.draw(S.sub_shape(pool), label="shape")
    names = data.draw(
        st.lists(st.sampled_from(list(shape)), min_size=1, max_size=len(shape), unique=True), label="reduced"
    )
    form = data.draw(st.sampled_from(["names", "string", "dims"]), label="dims form")
    layout = data.draw(S.layouts(mesh, pool), label="layout")
    cases = _cases(dims_arg(names, form, shape), names)
    spans, n = [], 0
    for name, _, _ in cases:
        k = 2 if name == "sum + sum" else 1
        spans.append(slice(n, n + k))
        n += k

    def fn(*xs):
        return {name: op(*xs[s]) for (name, op, _), s in zip(cases, spans)}

    def ref(*xs):
        return {name: op(*xs[s]) for (name, _, op), s in zip(cases, spans)}

    args = [harness.rand(rng, shape) for _ in range(n)]
    args = harness.sprinkle(rng, args, data.draw(S.specials(), label="NaN/inf/-0.0 share"))
    assume(harness.check(fn, args, ref, mesh, layout, backends=data.draw(S.backends(), label="backends")))


# ---- communication, by hand ----

MESH = "data4_model2"
BATCH_VOCAB = {"batch": 8, "vocab": 16}


@pytest.mark.parametrize("kind", list(MD_REDUCE))
def test_reduction_over_split_dim_is_one_all_reduce(kind):
    # vocab split over model (2 devices): the local result is [batch=8/4] = 8 bytes, and an
    # all-reduce over 2 devices moves 2 * (2 - 1) / 2 * 8 = 8 bytes per device.
    rng = np.random.default_rng(1)
    mesh, layout = harness.mesh(MESH), md.Layout({"batch": "data", "vocab": "model"})
    x = harness.rand(rng, BATCH_VOCAB)
    fn = lambda x: MD_REDUCE[kind](x, "vocab")  # noqa: E731
    assert harness.check(fn, [x], lambda x: R.reduce(kind, x, "vocab"), mesh, layout)
    assert harness.assert_explain_matches_hlo(fn, mesh, layout, [x]) == {"all-reduce": {"count": 1, "bytes": 8.0}}


@pytest.mark.parametrize("kind", list(MD_REDUCE))
def test_reduction_over_all_dims_is_one_all_reduce_over_both_axes(kind):
    # A scalar result: one all-reduce over all 8 devices of 4 bytes, 2 * 7/8 * 4 = 7 bytes.
    rng = np.random.default_rng(2)
    mesh, layout = harness.mesh(MESH), md.Layout({"batch": "data", "vocab": "model"})
    x = harness.rand(rng, BATCH_VOCAB)
    fn = lambda x: MD_REDUCE[kind](x)  # noqa: E731
    assert harness.check(fn, [x], lambda x: R.reduce(kind, x), mesh, layout)
    assert harness.assert_explain_matches_hlo(fn, mesh, layout, [x]) == {"all-reduce": {"count": 1, "bytes": 7.0}}


@pytest.mark.parametrize("kind", list(MD_REDUCE))
def test_reduction_over_unsplit_dim_communicates_nothing(kind):
    rng = np.random.default_rng(3)
    mesh, layout = harness.mesh(MESH), md.Layout({"batch": ("data", "model")})
    x = harness.rand(rng, BATCH_VOCAB)
    fn = lambda x: MD_REDUCE[kind](x, "vocab")  # noqa: E731
    assert harness.check(fn, [x], lambda x: R.reduce(kind, x, "vocab"), mesh, layout)
    assert harness.assert_explain_matches_hlo(fn, mesh, layout, [x]) == {}


@pytest.mark.parametrize("name", ["logsumexp", "softmax", "log_softmax"])
def test_softmax_family_over_split_vocab_is_one_max_and_one_sum(name):
    # Two all-reduces over model of the local [batch=2] partial results: 8 bytes each.
    rng = np.random.default_rng(4)
    mesh, layout = harness.mesh(MESH), md.Layout({"batch": "data", "vocab": "model"})
    x = harness.rand(rng, BATCH_VOCAB)
    fn = lambda x: getattr(md, name)(x, "vocab")  # noqa: E731
    assert harness.check(fn, [x], lambda x: getattr(R, name)(x, "vocab"), mesh, layout)
    assert harness.assert_explain_matches_hlo(fn, mesh, layout, [x]) == {"all-reduce": {"count": 2, "bytes": 16.0}}


def test_reduce_over_dim_split_on_axis_tuple():
    # batch split over (data, model): all 8 devices; the mean over it is one all-reduce of the
    # local [vocab=16] partial sum (64 bytes): 2 * 7/8 * 64 = 112 bytes.
    rng = np.random.default_rng(5)
    mesh, layout = harness.mesh(MESH), md.Layout({"batch": ("data", "model")})
    x = harness.rand(rng, BATCH_VOCAB)
    fn = lambda x: md.reduce_mean(x, "batch")  # noqa: E731
    assert harness.check(fn, [x], lambda x: R.reduce("mean", x, "batch"), mesh, layout)
    assert harness.assert_explain_matches_hlo(fn, mesh, layout, [x]) == {"all-reduce": {"count": 1, "bytes": 112.0}}


@pytest.mark.parametrize("backend", harness.BACKENDS)
@pytest.mark.parametrize("kind", ["max", "min"])
def test_reduce_max_gradient_is_one_hot_of_argmax(backend, kind):
    # No ties (distinct random values): d/dx sum(reduce_max(x, vocab) * c) puts c[b] at the
    # argmax of row b and 0 elsewhere. numpy only, no autodiff in the reference.
    rng = np.random.default_rng(6)
    mesh, layout = harness.mesh(MESH), md.Layout({"batch": "data", "vocab": "model"})
    x = harness.rand(rng, BATCH_VOCAB)
    c = harness.rand(rng, {"batch": 8})
    op = MD_REDUCE[kind]

    def grad(x, c):
        return jax.grad(lambda x: md.reduce_sum(op(x, "vocab") * c).array)(x)

    got = md.compile(grad, mesh, layout, backend=backend)(x, c)
    xs = x.numpy()
    arg = xs.argmax(axis=1) if kind == "max" else xs.argmin(axis=1)
    want = np.zeros_like(xs)
    want[np.arange(8), arg] = c.numpy()
    np.testing.assert_array_equal(got.numpy(), want)
    harness.assert_laid_out(got, layout, mesh, "gradient")


TIES = np.array([1, 1, 1, 0] + [0] * 12, np.float32)
"""Three tied maxima split over 8 devices: two on device 0, one on device 1."""


def _tied_max_gradient(backend):
    mesh, layout = harness.mesh("x8"), md.Layout({"n": "x"})
    x = harness.from_numpy(TIES, [md.Dim("n", 16)])

    def grad(x):
        return jax.grad(lambda x: md.reduce_max(x).array)(x)

    return md.compile(grad, mesh, layout, backend=backend)(x).numpy()


@pytest.mark.parametrize("backend", ["spmd", "gspmd"])
def test_reduce_max_gradient_with_ties_goes_to_the_first_maximum(backend):
    # As argmax picks (not jnp.max's even split, which needs a bit-for-bit comparison XLA does not
    # promise: test_programs.py::test_max_gradient_when_xla_recomputes_its_operand).
    want = np.zeros_like(TIES)
    want[np.argmax(TIES)] = 1.0
    np.testing.assert_array_equal(_tied_max_gradient(backend), want)


# ---- jax.grad around md.compile (the README's pattern) ----
#
# Differentiating a compiled function differentiates its jaxpr after tracing, so JAX calls the
# custom derivative rules (softmax's JVP, the split maximum's) outside md.compile's lowering.
# Each op gets an input of its own; the loss weights every result by a tensor the function closes
# over. Reference: jax.grad of the same loss in jax.numpy on one device.

AROUND = {
    "softmax": (lambda x: md.softmax(x, "cols"), lambda x: R.softmax(x, "cols")),
    "softmax all": (lambda x: md.softmax(x, ["rows", "cols"]), lambda x: R.softmax(x, ["rows", "cols"])),
    "log_softmax": (lambda x: md.log_softmax(x, "cols"), lambda x: R.log_softmax(x, "cols")),
    "logsumexp": (lambda x: md.logsumexp(x, "cols"), lambda x: R.logsumexp(x, "cols")),
    "reduce_max": (lambda x: md.reduce_max(x, "cols"), lambda x: R.reduce("max", x, "cols")),
    "reduce_min": (lambda x: md.reduce_min(x, "rows"), lambda x: R.reduce("min", x, "rows")),
    "reduce_max all": (lambda x: md.reduce_max(x), lambda x: R.reduce("max", x)),
}
ROWS_COLS = {"rows": 4, "cols": 8}


def _grad_around_reference(refs, xs, weight):
    """jax.grad of sum_i sum(refs[i](xs[i]) * weight) in jax.numpy on one device, per input."""
    on_one = lambda a: jax.device_put(a.numpy(), jax.devices()[0])  # noqa: E731

    def loss(arrays):
        w = R.Named(on_one(weight), weight.names)
        return sum(jnp.sum((ref(R.Named(a, x.names)) * w).array) for ref, a, x in zip(refs, arrays, xs))

    return jax.jit(jax.grad(loss))([on_one(x) for x in xs])


@pytest.mark.parametrize("backend", harness.BACKENDS)
@pytest.mark.parametrize("layout", ["", "cols:a", "rows:b; cols:(a c)"])
def test_grad_around_compile_of_ops_with_custom_derivatives(backend, layout):
    rng = np.random.default_rng(8)
    mesh = harness.mesh("a2_b2_c2")
    ops, refs = zip(*AROUND.values())
    xs = [harness.rand(rng, ROWS_COLS) for _ in ops]
    weight = harness.rand(rng, ROWS_COLS)

    def fn(*ts):
        terms = [md.reduce_sum(op(t) * weight) for op, t in zip(ops, ts)]
        return functools.reduce(operator.add, terms)

    compiled = md.compile(fn, mesh, layout, backend=backend)
    grads = jax.grad(lambda ts: compiled(*ts).array)(xs)
    for name, g, want in zip(AROUND, grads, _grad_around_reference(refs, xs, weight)):
        assert isinstance(g, md.Tensor) and g.names == ("rows", "cols"), name
        harness.assert_values_close(g.numpy(), want, harness.GRAD_TOL, f"{backend} gradient of {name}")
        harness.assert_laid_out(g, md.Layout(layout), mesh, f"{backend} gradient of {name}")


@pytest.mark.parametrize(
    "layout, stored", [("rows:a", "cols:a"), ("rows:(a b)", "cols:(a b)"), ("rows:a; cols:b", "cols:(b c)")]
)
def test_grad_around_compile_with_narrow_gradient_sums(layout, stored):
    # The other custom rules: with grad_reduce_dtype, a replicated operand met by a split one
    # (u) and a stored split parameter gathered beside split operands (w, FSDP) sum their
    # gradients in bfloat16 through custom VJPs. Tolerance: bfloat16 sums of a few terms.
    rng = np.random.default_rng(9)
    mesh = harness.mesh("a2_b2_c2")
    x, w, u = harness.rand(rng, ROWS_COLS), harness.rand(rng, {"cols": 8}), harness.rand(rng, {"cols": 8})
    c = harness.rand(rng, ROWS_COLS)

    def fn(x, w, u):
        return md.reduce_sum(md.softmax(x * w + u, "cols") * c)

    compiled = md.compile(fn, mesh, layout, in_layouts=[None, stored, None], grad_reduce_dtype=jnp.bfloat16)
    grads = jax.grad(lambda *ts: compiled(*ts).array, argnums=(0, 1, 2))(x, w, u)

    def ref(x, w, u):
        return jnp.sum(jax.nn.softmax(x * w + u, axis=1) * c.numpy())

    want = jax.jit(jax.grad(ref, argnums=(0, 1, 2)))(*(jnp.asarray(t.numpy()) for t in (x, w, u)))
    for name, g, v, t in zip("xwu", grads, want, (x, w, u)):
        assert g.names == t.names, name
        harness.assert_values_close(g.numpy(), v, 2e-2, f"gradient of {name}")


# ---- fully masked rows (issue 21) and gspmd's bytes (issue 22) -----------------------------------

_JAX_SOFTMAX = {"logsumexp": jax.nn.logsumexp, "softmax": jax.nn.softmax, "log_softmax": jax.nn.log_softmax}


def _masked_rows() -> tuple[np.ndarray, np.ndarray]:
    """A [batch=4, vocab=16] input whose row 1 is all -inf and row 2 has a masked half, and the mask."""
    x = np.random.default_rng(11).standard_normal((4, 16)).astype(np.float32)
    mask = np.zeros((4, 16), bool)
    mask[1], mask[2, ::2] = True, True
    return np.where(mask, -np.inf, x), mask


@pytest.mark.parametrize("backend", ["eager", *harness.BACKENDS])
@pytest.mark.parametrize("name", list(_JAX_SOFTMAX))
def test_softmax_family_of_fully_masked_rows_equals_jax_nn(name, backend):
    """A row of -inf: logsumexp is -inf (it was -inf - -inf = nan), softmax and log_softmax are what
    jax.nn's give (nan); and the gradient through a mask of each finite output is jax's, finite."""
    x, mask = _masked_rows()
    cot = np.random.default_rng(12).standard_normal((4, 16)).astype(np.float32)
    dims = harness.dims({"batch": 4, "vocab": 16})
    keep = md.tensor(~mask, dims)
    fn, ref = getattr(md, name), _JAX_SOFTMAX[name]

    def md_loss(a):
        y = fn(md.where(keep, a, -np.inf), "vocab")
        y = md.where(md.equal(y, y) & md.not_equal(md.abs(y), np.inf), y, 0.0)  # the finite outputs
        c = md.tensor(cot, dims) if name != "logsumexp" else md.tensor(cot[:, 0], dims[:1])
        return md.reduce_sum(y * c).array

    def ref_loss(a):
        y = ref(jnp.where(~mask, a, -jnp.inf), axis=1)
        y = jnp.where(jnp.isfinite(y), y, 0.0)
        return jnp.sum(y * (cot if name != "logsumexp" else cot[:, 0]))

    def both(a):
        return fn(a, "vocab"), jax.grad(md_loss)(a)

    t = md.tensor(x, dims)
    got = (
        both(t)
        if backend == "eager"
        else md.compile(both, harness.mesh(MESH), "batch:data; vocab:model", backend=backend)(t)
    )
    np.testing.assert_allclose(got[0].numpy(), ref(x, axis=1), rtol=1e-6, atol=1e-6, equal_nan=True)
    want = jax.grad(ref_loss)(np.where(mask, 0.0, x).astype(np.float32))
    assert np.isfinite(want).all()
    np.testing.assert_allclose(got[1].numpy(), want, rtol=1e-5, atol=1e-6)
    if name == "logsumexp":
        assert got[0].numpy()[1] == -np.inf


@pytest.mark.parametrize("name", list(_JAX_SOFTMAX))
def test_gspmd_softmax_family_over_split_vocab_moves_what_spmd_moves(name):
    """gspmd's softmax family over a split dim: one max and one sum all-reduce, as spmd (the max's
    derivative rule used to reach XLA as a (value, index) reduction, two all-gathers), forward and
    with its gradient; values and gradients checked against the reference by harness.check."""
    rng = np.random.default_rng(13)
    mesh, layout = harness.mesh(MESH), md.Layout({"batch": "data", "vocab": "model"})
    x = harness.rand(rng, BATCH_VOCAB)
    cot = harness.rand(rng, {"batch": 8} if name == "logsumexp" else BATCH_VOCAB)
    fn = lambda x: getattr(md, name)(x, "vocab")  # noqa: E731
    assert harness.check(fn, [x], lambda x: getattr(R, name)(x, "vocab"), mesh, layout)

    def grad(x):
        return jax.grad(lambda x: md.reduce_sum(fn(x) * cot).array)(x)

    for f in (fn, grad):
        spmd, gspmd = (md.compile(f, mesh, layout, backend=b).lower(x).compile().as_text() for b in harness.BACKENDS)
        assert hlo.summary(gspmd) == hlo.summary(spmd) and set(hlo.summary(gspmd)) == {"all-reduce"}


# ---- non-finite values under a split (docs/design.md, "Non-finite values under a split") ----

SPECIAL_ROWS = np.array(
    [
        [0, 1, 2, np.nan, 4, 5, 6, 7],  # the case: one NaN, elsewhere numbers
        [8, 9, np.inf, 11, 12, -np.inf, 14, 15],
        [-np.inf] * 8,  # a fully masked row
        [-0.0, -0.0, -0.0, -0.0, -0.0, 0.0, -0.0, -0.0],  # a zero maximum: +0.0, as jnp.max
        [-0.0] * 8,
        [1, np.nan, 3, -np.nan, np.inf, 2, np.nan, 0],  # NaN of both signs, the first NaN's index
        [np.inf, np.inf, 0, -1, -1, 0, 0, 0],
        [3, 2, 1, 0, -1, -2, -3, -np.inf],
    ],
    np.float32,
)
K3 = md.Dim("k", 3)
SPECIAL_OPS = {
    "reduce_max": (lambda x: md.reduce_max(x, "c"), lambda a: jnp.max(a, 1)),
    "reduce_min": (lambda x: md.reduce_min(x, "c"), lambda a: jnp.min(a, 1)),
    "reduce_max all": (lambda x: md.reduce_max(x), lambda a: jnp.max(a)),
    "reduce_min rows": (lambda x: md.reduce_min(x, "r"), lambda a: jnp.min(a, 0)),
    "argmax": (lambda x: md.argmax(x, "c"), lambda a: jnp.argmax(a, 1)),
    "logsumexp": (lambda x: md.logsumexp(x, "c"), lambda a: jax.nn.logsumexp(a, 1)),
    "softmax": (lambda x: md.softmax(x, "c"), lambda a: jax.nn.softmax(a, 1)),
    "log_softmax": (lambda x: md.log_softmax(x, "c"), lambda a: jax.nn.log_softmax(a, 1)),
    "top_k values": (lambda x: md.top_k(x, "c", K3)[0], lambda a: jax.lax.top_k(a, 3)[0]),
    "top_k indices": (lambda x: md.top_k(x, "c", K3)[1], lambda a: jax.lax.top_k(a, 3)[1]),
    "cumsum": (lambda x: md.cumsum(x, "c"), lambda a: jnp.cumsum(a, 1)),
}


@pytest.mark.parametrize(
    "backend, axes, layout",
    [
        ("spmd", {"x": 4, "y": 2}, "c:x"),  # the case: c over 4 devices
        ("spmd", {"x": 8}, "c:x"),  # one entry per device
        ("spmd", {"x": 2, "y": 4}, "r:x; c:y"),
        ("gspmd", {"x": 2, "y": 4}, "c:x"),  # the gspmd case: c over 2 devices
        ("gspmd", {"x": 8}, "c:x"),
    ],
)
def test_non_finite_values_under_a_split_are_those_of_jnp(backend, axes, layout):
    # NaN, +-inf and -0.0 give what jnp gives on the global array, under every layout: a pmax
    # (and XLA's all-reduce max on CPU) drops NaN, which gave [7, 15] for a max over a split c
    # where the whole array gives [nan, 15], and argmax 7 for 3.
    x = harness.from_numpy(SPECIAL_ROWS, [md.Dim("r", 8), md.Dim("c", 8)])
    got = md.compile(lambda x: {k: f(x) for k, (f, _) in SPECIAL_OPS.items()}, md.Mesh(axes), layout, backend=backend)(
        x
    )
    for name, (_, ref) in SPECIAL_OPS.items():
        want = np.asarray(ref(jnp.asarray(SPECIAL_ROWS)))
        value = got[name].numpy()
        np.testing.assert_array_equal(value, want, err_msg=f"{backend} {layout}: {name}")
        if name.startswith("reduce"):  # the sign of a zero extremum too
            zero = want == 0
            np.testing.assert_array_equal(np.signbit(value[zero]), np.signbit(want[zero]), err_msg=f"{name} signs")
