"""md.scan over a ``layers`` dim of stacked parameters, against a numpy loop over the layers.

The body is a residual MLP layer, ``h + einsum(tanh(einsum(h, w)), v) * s``, that also emits a
per-layer output (stacked along ``layers`` in front). The drawn test runs it under drawn meshes
and layouts (``layers`` itself often split, so scan gathers it first) with and without
``remat`` through the full harness check: carry and stacked outputs equal the loop, gradients of
the initial carry and of every parameter equal jax.grad of the loop, shardings, and md.explain
== the compiled HLO (collectives inside the loop counted once per layer on both sides).

Unit tests: a split ``layers`` dim costs one all-gather per scanned tensor, before the loop; and
parameters stored under another layout (``in_layouts``, FSDP style: ``d`` split over an axis the
compute layout leaves alone) give the same values and gradients, gathered one layer at a time
inside the loop, the gradients leaving reduce-scattered into the stored layout.
"""

import harness
import jax
import numpy as np
import pytest
import reference as R
import strategies as S
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from reference import Named

import meshdsl as md
from meshdsl.analysis import hlo

D = md.Dim


def layer(h, p):
    u = md.tanh(md.einsum(h, p["w"], out=["batch", "d_ff"]))
    h = h + md.einsum(u, p["v"], out=["batch", "d"]) * p["s"]
    return h, md.reduce_sum(h, "d")


def scan_fn(remat):
    def fn(h0, w, v, s):
        return md.scan(layer, h0, {"w": w, "v": v, "s": s}, "layers", remat=remat)

    return fn


def scan_ref(h0, w, v, s):
    """The loop over layers, written out: (final carry, per-layer outputs stacked along layers)."""
    h, ys = h0, []
    for wi, vi, si in zip(R.unstack(w, "layers"), R.unstack(v, "layers"), R.unstack(s, "layers")):
        u = R.tanh(R.einsum("batch d_ff", h, wi))
        h = h + R.einsum("batch d", u, vi) * si
        ys.append(R.reduce("sum", h, "d"))
    return h, R.stack(ys, "layers", 0)


def params(rng, sizes, orders=("layers d d_ff", "layers d_ff d", "layers d")):
    """h0[batch, d] and the stacked w, v, s with their dims in the given orders (0.5-scaled)."""
    h0 = harness.rand(rng, {"batch": sizes["batch"], "d": sizes["d"]})
    out = [h0]
    for order in orders:
        t = harness.rand(rng, [(n, sizes[n]) for n in order.split()])
        out.append(md.tensor(t.array * 0.5, t.shape))
    return out


@settings(max_examples=S.examples(6))
@given(
    mesh=S.meshes(),
    data=st.data(),
    rng=S.rngs(),
    remat=st.booleans(),
    layers=st.sampled_from([2, 4, 8]),
    sizes=st.fixed_dictionaries({"batch": S.sizes(), "d": S.sizes(), "d_ff": S.sizes()}),
)
def test_scan_matches_a_loop(mesh, data, rng, remat, layers, sizes):
    sizes = {**sizes, "layers": layers}
    w_order = data.draw(st.sampled_from(["layers d d_ff", "d layers d_ff", "d d_ff layers"]), label="w dims")
    layout = data.draw(S.layouts_splitting(mesh, sizes, "layers", p_split=0.5), label="layout")
    args = params(rng, sizes, (w_order, "layers d_ff d", "d layers"))
    assume(harness.check(scan_fn(remat), args, scan_ref, mesh, layout, tol=1e-5 * layers, grad_tol=1e-5 * layers))


# ---- by hand ----

SIZES = {"batch": 8, "d": 16, "d_ff": 8, "layers": 4}


@pytest.mark.parametrize(
    ("mesh", "layout"),
    [
        ("x8", {"layers": ("x",)}),
        ("data4_model2", {"layers": ("data",), "batch": ("model",)}),
        ("a2_b2_c2", {"layers": ("c", "a"), "d_ff": ("b",)}),
    ],
)
def test_split_layers_gathered_once_before_the_loop(mesh, layout):
    # layers over A: w, v and s are each all-gathered along layers once (3 all-gathers, not one
    # per layer); the layer body then needs nothing but d_ff's reduction, if d_ff is split.
    m = harness.mesh(mesh)
    sizes = {**SIZES, "layers": 8}
    args = params(np.random.default_rng(0), sizes)
    fn = scan_fn(False)
    assert harness.check(fn, args, scan_ref, m, layout, grad=False)
    s = md.explain(fn, m, layout, *args).summary()
    assert s["all-gather"]["count"] == 3, s
    # d_ff split: one all-reduce of the partial second einsum per layer.
    assert s.get("all-reduce", {"count": 0})["count"] == (8 if "d_ff" in layout else 0), s


@pytest.mark.parametrize("remat", [False, True])
def test_scan_gradients_with_remat(remat):
    m, layout = harness.mesh("data4_model2"), {"batch": "data", "d_ff": "model"}
    args = params(np.random.default_rng(1), SIZES)
    assert harness.check(scan_fn(remat), args, scan_ref, m, layout)


# Stored layout: the parameters (w, v, s) are kept with d split over mesh axes the compute
# layout does not give d; h0 follows the compute layout. (mesh, compute rules, stored rules, the
# gradients leave reduce-scattered: when the computation varies along the stored axes, i.e. FSDP.)
STORED = [
    # mesh, compute rules, stored rules, gradient reduce-scattered, all-gathers a layer (w, v and s
    # in one, but those split over model apart from s, which is not: see lowering.gather_stored)
    ("x8", {}, {"d": "x"}, False, 1),
    ("data4_model2", {"batch": "data"}, {"d": "data"}, True, 1),
    pytest.param("data4_model2", {"batch": "data", "d_ff": "model"}, {"d": "data", "d_ff": "model"}, True, 2),
    ("a2_b2_c2", {"batch": ("a", "b")}, {"d": ("b", "a")}, True, 1),
]


def _grad_fn(fn, cot_h, cot_y):
    def grad(h0, w, v, s):
        def loss(h0, w, v, s):
            h, ys = fn(h0, w, v, s)
            return (md.reduce_sum(h * cot_h) + md.reduce_sum(ys * cot_y)).array

        return jax.grad(loss, argnums=(0, 1, 2, 3))(h0, w, v, s)

    return grad


def _grad_ref(args, cot_h, cot_y):
    """jax.grad of the loop in jax.numpy on one device."""
    names = [a.names for a in args]

    def loss(*arrays):
        h, ys = scan_ref(*(Named(a, n) for a, n in zip(arrays, names)))
        return (h.to("batch d").array * cot_h).sum() + (ys.to("layers batch").array * cot_y).sum()

    dev = jax.devices()[0]
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*(jax.device_put(a.numpy(), dev) for a in args))


@pytest.mark.parametrize(
    ("mesh", "layout", "stored", "scattered", "gathers"),
    STORED,
    ids=lambda v: str(v) if isinstance(v, (str, dict)) else None,
)
def test_stored_parameter_layout(mesh, layout, stored, scattered, gathers):
    m = harness.mesh(mesh)
    compute, stored = md.Layout(layout), md.Layout({**layout, **stored})
    rng = np.random.default_rng(2)
    args = params(rng, SIZES)
    in_layouts = (None, stored, stored, stored)
    args = [
        harness.from_numpy(a.numpy(), a.shape.dims, harness.expected_sharding(lay or compute, m, a.names))
        for a, lay in zip(args, in_layouts)
    ]
    want_h, want_ys = scan_ref(*(Named(a.numpy().astype(np.float64), a.names) for a in args))
    fn = scan_fn(remat=False)

    for backend in harness.BACKENDS:
        h, ys = md.compile(fn, m, compute, backend=backend, in_layouts=in_layouts)(*args)
        harness.assert_close(h, want_h, 1e-5, f"{backend} carry")
        harness.assert_close(ys, want_ys, 1e-5, f"{backend} ys")
        harness.assert_laid_out(h, compute, m, f"{backend} carry")
    forward = _explain_equals_hlo(fn, m, compute, args, in_layouts, None)
    # d's stored split is gathered layer by layer inside the loop, w, v and s together.
    assert forward["all-gather"]["count"] == gathers * SIZES["layers"], forward

    cot_h = rng.standard_normal((SIZES["batch"], SIZES["d"])).astype(np.float32)
    cot_y = rng.standard_normal((SIZES["layers"], SIZES["batch"])).astype(np.float32)
    want = _grad_ref(args, cot_h, cot_y)
    cots = (
        md.tensor(cot_h, harness.dims({"batch": 8, "d": 16})),
        md.tensor(cot_y, harness.dims({"layers": 4, "batch": 8})),
    )
    grad = _grad_fn(fn, *cots)
    # gradients leave in the layout their parameters are stored in (FSDP's reduce-scatter).
    out_layouts = (compute, stored, stored, stored)
    for backend in harness.BACKENDS:
        got = md.compile(grad, m, compute, backend=backend, in_layouts=in_layouts, out_layouts=out_layouts)(*args)
        for g, w_, a, lay, what in zip(got, want, args, out_layouts, ["h0", "w", "v", "s"]):
            harness.assert_close(g, Named(np.asarray(w_, np.float64), a.names), 1e-5, f"{backend} gradient of {what}")
            harness.assert_laid_out(g, lay, m, f"{backend} gradient of {what}")
    backward = _explain_equals_hlo(grad, m, compute, args, in_layouts, out_layouts)
    assert ("reduce-scatter" in backward) == scattered, backward


def _explain_equals_hlo(fn, m, layout, args, in_layouts, out_layouts):
    compiled = md.compile(fn, m, layout, in_layouts=in_layouts, out_layouts=out_layouts)
    predicted = md.explain(fn, m, layout, *args, in_layouts=in_layouts, out_layouts=out_layouts).summary()
    actual = hlo.summary(compiled.lower(*args).compile().as_text())
    assert predicted == actual
    return actual


# A pending partial sum times a tensor held in another layout than the compute rules (an
# in_layouts argument, or md.scan's slice of a stored parameter): the factor is relayouted first.
def test_pending_sum_times_a_stored_tensor():
    m = harness.mesh("data4_model2")
    rng = np.random.default_rng(5)
    u, v, s = (
        harness.rand(rng, {"batch": 2, "d_ff": 4}),
        harness.rand(rng, {"d_ff": 4, "d": 8}),
        harness.rand(rng, {"d": 8}),
    )

    def fn(u, v, s):
        return md.einsum(u, v, out=["batch", "d"]) * s

    got = md.compile(fn, m, {"d_ff": "model"}, in_layouts=(None, None, {"d": "data"}))(u, v, s)
    harness.assert_close(
        got,
        R.einsum("batch d", Named(u.numpy(), u.names), Named(v.numpy(), v.names)) * Named(s.numpy(), ["d"]),
        1e-5,
        "spmd",
    )


def test_explain_of_a_one_layer_scan_gradient():
    # XLA removes the one-trip loop, then drops the sum only the dead forward carry needs: explain must too.
    m, layout = harness.mesh("x8"), {"d_ff": "x"}

    def grad(h0, w):
        def body(h, w):
            return h + md.einsum(md.tanh(md.einsum(h, w, out=["d_ff"])), w, out=["d"]), None

        return jax.grad(lambda h0: md.reduce_sum(md.scan(body, h0, w, "layers")[0]).array)(h0)

    rng = np.random.default_rng(4)
    h0, w = harness.rand(rng, {"d": 4}), harness.rand(rng, {"layers": 1, "d": 4, "d_ff": 8})
    harness.assert_explain_matches_hlo(grad, m, layout, [h0, w])


# ---- carries made inside the compiled function ----
#
# A carry built by md.zeros / full / ones / range or from a constant is, inside shard_map, the
# same on every device (JAX types it invariant), while the body's carry out may vary along the
# axes of a split (c + x, x a slice of split xs): the initial carry must be typed like it.

CONSTANT = np.linspace(-1, 1, 8, dtype=np.float32)


def carries_fn(xs, h0):
    # Each carry that adds a sum over a split dim is scaled too: a step's gradient that is the
    # same on every step makes XLA hoist its all-reduce out of the backward loop, which md.explain
    # does not model (reported apart).
    init = {
        "zeros": md.zeros([D("h", 8)]),
        "full": md.full([D("h", 8)], 0.5),
        "ones": md.ones([D("b", 2), D("h", 8)]),
        "range": md.cast(md.range(D("h", 8)), np.float32),
        "constant": md.tensor(CONSTANT, [D("h", 8)]),
        "scalar": md.zeros([]),
        "input": h0,
        "input times zeros": h0 * md.zeros([D("b", 2)]),
    }

    def body(c, x):
        return {
            "zeros": c["zeros"] + x,
            "full": c["full"] * md.tanh(x),
            "ones": c["ones"] * 0.5 + x,
            "range": c["range"] + x * c["range"],
            "constant": c["constant"] * 0.9 - md.reduce_sum(x),
            "scalar": c["scalar"] + md.reduce_sum(x * c["constant"]),
            "input": c["input"] * x,
            "input times zeros": c["input times zeros"] * 0.9 + md.reduce_sum(x * c["input"]),
        }, x * c["zeros"]

    return md.scan(body, init, xs, "steps")


def carries_ref(xs, h0):
    zeros = 0 * h0  # [h], zeros of the reference's array kind
    c = {
        "zeros": zeros,
        "full": zeros + 0.5,
        "ones": Named(np.ones(2), ["b"]) + zeros,
        "range": zeros + np.arange(8),
        "constant": zeros + CONSTANT,
        "scalar": R.reduce("sum", zeros),
        "input": h0,
        "input times zeros": h0 * Named(np.zeros(2), ["b"]),
    }
    ys = []
    for x in R.unstack(xs, "steps"):
        ys.append(x * c["zeros"])
        c = {
            "zeros": c["zeros"] + x,
            "full": c["full"] * R.tanh(x),
            "ones": c["ones"] * 0.5 + x,
            "range": c["range"] + x * c["range"],
            "constant": c["constant"] * 0.9 - R.reduce("sum", x),
            "scalar": c["scalar"] + R.reduce("sum", x * c["constant"]),
            "input": c["input"] * x,
            "input times zeros": c["input times zeros"] * 0.9 + R.reduce("sum", x * c["input"]),
        }
    return c, R.stack(ys, "steps", 0)


@pytest.mark.parametrize("layout", [{"h": "a"}, {"h": ("a", "b"), "b": "c"}, {"steps": "a", "h": "b"}])
def test_carries_made_inside_the_function(layout):
    rng = np.random.default_rng(6)
    xs, h0 = harness.rand(rng, {"steps": 4, "h": 8}), harness.rand(rng, {"h": 8})
    assert harness.check(carries_fn, [xs, h0], carries_ref, harness.mesh("a2_b2_c2"), layout)


def test_scan_errors():
    rng = np.random.default_rng(3)
    h0, w, v, s = params(rng, SIZES)
    with pytest.raises(md.ShapeError):
        md.scan(layer, h0, {"w": w, "v": v, "s": harness.rand(rng, {"d": 16})}, "layers")  # s lacks layers
    with pytest.raises(md.ShapeError):
        md.scan(layer, h0, {"w": w, "v": v, "s": harness.rand(rng, {"layers": 3, "d": 16})}, "layers")  # another length
    with pytest.raises(md.ShapeError):
        md.scan(layer, h0, [], "layers")


def _fsdp_temporaries(layers: int, stored_axis: str, sizes: dict[str, int]) -> int:
    """Compiled temporaries (bytes per device) of the gradient of ``layers`` scanned layers on
    ``data=2 model=4``, compute ``batch:data``, the two weights of a layer stored ``d_model`` over ``stored_axis``."""
    m, compute = md.Mesh({"data": 2, "model": 4}), md.Layout({"batch": "data"})
    stored = md.Layout({"batch": "data", "d_model": stored_axis})
    rng = np.random.default_rng(6)
    h0 = harness.rand(rng, {"batch": sizes["batch"], "d_model": sizes["d_model"]})
    w = harness.rand(rng, {"layers": layers, "d_model": sizes["d_model"], "d_ff": sizes["d_ff"]})
    v = harness.rand(rng, {"layers": layers, "d_ff": sizes["d_ff"], "d_model": sizes["d_model"]})

    def step(h, p):
        return h + md.einsum(
            md.tanh(md.einsum(h, p["w"], out=["batch", "d_ff"])), p["v"], out=["batch", "d_model"]
        ), None

    def grad(h0, w, v):
        return jax.grad(
            lambda w, v: md.reduce_sum(md.scan(step, h0, {"w": w, "v": v}, "layers")[0]).array, argnums=(0, 1)
        )(w, v)

    compiled = md.compile(grad, m, compute, in_layouts=(None, stored, stored), out_layouts=stored)
    return compiled.lower(h0, w, v).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize(
    "stored_axis", ["data", "model"], ids=["activations-vary-along-storage", "activations-invariant-along-storage"]
)
def test_fsdp_layer_loop_holds_one_layers_gathered_weights(stored_axis):
    # ZeRO-3: each layer's weights are gathered again for its backward step, not saved, so adding
    # layers adds only their saved activations: the layer's input h [batch, d_model] and its two
    # [batch, d_ff] intermediates, batch split over data. One layer's gathered weights (2 d_model
    # d_ff floats) are over twice that; storing d_model over model gathers with the invariant
    # all_gather (nothing varies along model), over data with the varying one: both re-gathered.
    sizes = {"batch": 32, "d_model": 64, "d_ff": 256}
    rows = sizes["batch"] // 2
    activations = 4 * rows * (sizes["d_model"] + 2 * sizes["d_ff"])
    weights = 4 * 2 * sizes["d_model"] * sizes["d_ff"]
    assert weights > 2 * activations
    growth = (_fsdp_temporaries(6, stored_axis, sizes) - _fsdp_temporaries(2, stored_axis, sizes)) / 4
    assert growth <= activations, f"temporaries grow {growth:,.0f} B a layer; its activations are {activations:,} B"
