"""Generated tensors: md.random.bits / uniform / normal, md.dropout, and md.zeros / ones / full.

* Random values are layout-invariant: under every drawn mesh and layout, on both backends,
  ``md.random.X(key, shape)`` equals ``jax.random.X(key, sizes)`` computed on one device, bit
  for bit, for typed and raw keys. That each device draws only its own block cannot be seen
  from the values; what can is that the compiled program under a split layout runs no
  collective at all (checked on the HLO, and md.explain agrees).
* Dropout, through the full harness check (values and gradient with respect to x on both
  backends, shardings, explain == HLO): the kept mask is ``jax.random.uniform(key, noise
  shape) >= rate``, kept entries are scaled by ``1 / (1 - rate)``, a noise shape broadcasts the
  draw over the dims it leaves out, and rate 0 is the identity; the same under every layout.
* zeros / ones / full under drawn layouts: values, dtypes, shardings, no communication.
"""

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import strategies as S
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from reference import Named

import meshdsl as md
from meshdsl.analysis import hlo


def _key(seed: int, typed: bool):
    return jax.random.key(seed) if typed else jax.random.PRNGKey(seed)


def jax_random(key, sizes, minval, maxval):
    """The reference: jax.random on one device, in one jitted program (not op by op)."""

    def draw(k):
        return (
            jax.random.bits(k, sizes),
            jax.random.uniform(k, sizes),
            jax.random.uniform(k, sizes, minval=minval, maxval=maxval),
            jax.random.normal(k, sizes),
        )

    return [np.asarray(a) for a in jax.jit(draw)(jax.device_put(key, jax.devices()[0]))]


def md_random(shape, minval, maxval):
    def fn(key):
        return (
            md.random.bits(key, shape),
            md.random.uniform(key, shape),
            md.random.uniform(key, shape, minval=minval, maxval=maxval),
            md.random.normal(key, shape),
        )

    return fn


@settings(max_examples=S.examples(10))
@given(
    mesh=S.meshes(),
    pool=S.dim_pool(3),
    data=st.data(),
    seed=st.integers(0, 2**31 - 1),
    typed=st.booleans(),
    bounds=st.sampled_from([(-2.0, 3.0), (0.5, 0.75), (-1e3, 1e3)]),
)
def test_random_equals_jax_random_under_every_layout(mesh, pool, data, seed, typed, bounds):
    shape = data.draw(S.sub_shape(pool), label="shape")
    layout = data.draw(S.layouts_any_order(mesh, pool, risk=0.0), label="layout")
    dims = harness.dims(shape)
    key = _key(seed, typed)
    fn = md_random(dims, *bounds)
    want = jax_random(key, tuple(shape.values()), *bounds)
    for backend in harness.BACKENDS:
        compiled = md.compile(fn, mesh, layout, backend=backend)
        got = compiled(key)
        for name, g, w in zip(["bits", "uniform", "uniform bounds", "normal"], got, want):
            assert g.names == tuple(shape), name
            assert g.dtype == w.dtype, f"{backend} {name}: {g.dtype} != {w.dtype}"
            np.testing.assert_array_equal(g.numpy(), w, err_msg=f"{backend} {name} under {layout}")
            harness.assert_laid_out(g, layout, mesh, f"{backend} {name}")
        if backend == "spmd":
            # no collective: each device hashes the positions of its own block.
            assert harness.assert_explain_matches_hlo(fn, mesh, layout, [key], compiled) == {}
    lo, hi = bounds
    assert np.all((want[2] >= lo) & (want[2] < hi))


@pytest.mark.parametrize(
    ("mesh", "layout"),
    [
        ("x8", {"a": "x"}),
        ("data4_model2", {"a": ("model", "data")}),
        ("a2_b2_c2", {"a": ("c", "a"), "b": "b"}),
    ],
)
@pytest.mark.parametrize("backend", harness.BACKENDS)
def test_random_under_split_layout_compiles_no_collective(mesh, layout, backend):
    m = harness.mesh(mesh)
    dims = harness.dims({"a": 8, "b": 6, "c": 4})

    def fn(key, x):
        # random values feeding a computation with a split input: still nothing to exchange.
        return md.random.normal(key, dims) * x + md.random.uniform(key, dims), md.random.bits(key, dims)

    x = harness.from_numpy(
        np.ones((8, 6, 4), np.float32), dims, harness.expected_sharding(md.Layout(layout), m, ["a", "b", "c"])
    )
    compiled = md.compile(fn, m, layout, backend=backend)
    key = jax.random.key(7)
    text = compiled.lower(key, x).compile().as_text()
    assert hlo.summary(text) == {}
    normal, bits = compiled(key, x)
    np.testing.assert_array_equal(bits.numpy(), np.asarray(jax.random.bits(key, (8, 6, 4))))
    harness.assert_laid_out(normal, md.Layout(layout), m, "normal")
    if backend == "spmd":
        assert md.explain(fn, m, layout, key, x).summary() == {}


def test_random_shape_forms_and_bad_keys():
    key = jax.random.key(0)
    a = md.random.normal(key, [md.Dim("a", 4), md.Dim("b", 2)])
    b = md.random.normal(key, md.Shape([md.Dim("a", 4), md.Dim("b", 2)]))
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    np.testing.assert_array_equal(a.numpy(), np.asarray(jax.random.normal(key, (4, 2))))
    with pytest.raises(ValueError):
        md.random.bits(jnp.zeros((3,), jnp.uint32), [md.Dim("a", 4)])


# ---- dropout and constants, through the harness ----


def keep_mask(key, noise: dict, rate: float) -> Named:
    """``jax.random.uniform(key, noise shape) >= rate``, computed on one device (outside any trace)."""
    return Named(np.asarray(_uniform(key, tuple(noise.values()))) >= rate, list(noise))


_uniform = jax.jit(jax.random.uniform, static_argnums=1)
"""jax.random.uniform in one program per shape (eagerly, each of its ops would compile apart)."""


def dropout_ref(x: Named, rate: float, keep: Named) -> Named:
    """x * keep / (1 - rate), the mask broadcast by name; rate 0: x itself."""
    return x if rate == 0.0 else x * keep / (1.0 - rate)


@settings(max_examples=S.examples(10))
@given(
    mesh=S.meshes(),
    pool=S.dim_pool(3),
    data=st.data(),
    rng=S.rngs(),
    seed=st.integers(0, 2**31 - 1),
    rate=st.sampled_from([0.0, 0.1, 0.5, 0.9]),
)
def test_dropout_and_constants(mesh, pool, data, rng, seed, rate):
    shape = data.draw(S.sub_shape(pool), label="x dims")
    kept = data.draw(
        st.permutations(list(shape)).flatmap(lambda p: st.integers(1, len(p)).map(lambda k: p[:k])), label="noise dims"
    )
    noise = data.draw(st.sampled_from([None, {n: shape[n] for n in kept}]), label="noise shape")
    layout = data.draw(S.layouts_any_order(mesh, pool), label="layout")
    key = jax.random.key(seed)
    dims = harness.dims(shape)

    def fn(x):
        return {
            "dropout": md.dropout(key, x, rate, None if noise is None else harness.dims(noise)),
            "zeros": md.zeros(dims),
            "ones int32": md.ones(dims, jnp.int32),
            "full": md.full(dims, 2.5),
            "full bool": md.full(dims, True, jnp.bool_),
        }

    keep = keep_mask(key, noise if noise is not None else shape, rate)

    def ref(x):
        sizes = tuple(shape.values())
        return {
            "dropout": dropout_ref(x, rate, keep),
            "zeros": Named(np.zeros(sizes, np.float32), list(shape)),
            "ones int32": Named(np.ones(sizes, np.int32), list(shape)),
            "full": Named(np.full(sizes, 2.5, np.float32), list(shape)),
            "full bool": Named(np.ones(sizes, bool), list(shape)),
        }

    args = [harness.rand(rng, shape)]
    assume(harness.check(fn, args, ref, mesh, layout))
    assert md.explain(fn, mesh, layout, *args).summary() == {}


def _ones_x(mesh, layout, spec):
    ds = harness.dims(spec)
    return harness.from_numpy(
        np.ones([d.size for d in ds], np.float32),
        ds,
        harness.expected_sharding(md.Layout(layout), mesh, [d.name for d in ds]),
    )


RATES = (0.25, 0.75)


@pytest.mark.parametrize(
    ("mesh", "layout"),
    [
        ("x8", {"d": "x"}),
        ("data4_model2", {"batch": "data", "d": "model"}),
        ("a2_b2_c2", {"batch": ("b", "a"), "seq": "c"}),
    ],
)
def test_dropout_mask_and_scale_are_the_same_under_every_layout(mesh, layout):
    # x = 1: the result is 1 / (1 - rate) exactly where uniform(key) >= rate, else 0.
    key = jax.random.key(11)
    u = np.asarray(jax.random.uniform(key, (8, 4, 16)))
    m = harness.mesh(mesh)
    x = _ones_x(m, layout, {"batch": 8, "seq": 4, "d": 16})
    for backend in harness.BACKENDS:
        got = md.compile(lambda x: [md.dropout(key, x, r) for r in RATES], m, layout, backend=backend)(x)
        for rate, g in zip(RATES, got):
            scale = np.float32(1 / (1 - rate))
            np.testing.assert_allclose(
                g.numpy(), np.where(u >= rate, scale, 0), rtol=1e-6, err_msg=f"{backend} rate {rate}"
            )
            assert set(np.unique(g.numpy())) <= {0.0, scale}
            assert abs(float(np.mean(g.numpy() == 0)) - rate) < 0.1  # roughly the rate dropped (512 draws)


@pytest.mark.parametrize("layout", ["", "d:model", "batch:data; d:model"])
def test_dropout_drops_nan_and_inf_to_zero_everywhere(layout):
    """A dropped NaN or inf is 0, eagerly and compiled, under every layout (issue 31): x * mask gave
    NaN eagerly, and compiled 0 or NaN as XLA's fusion turned the product into a select or not."""
    key, rate = jax.random.key(3), 0.5
    a = np.full((4, 8), np.inf, np.float32)
    a[::2, ::3] = np.nan
    x = harness.from_numpy(a, harness.dims({"batch": 4, "d": 8}))
    keep = np.asarray(jax.random.uniform(key, (8,))) >= rate  # noise over d
    want = np.where(keep, a, 0.0)
    np.testing.assert_array_equal(md.dropout(key, x, rate, [md.Dim("d", 8)]).numpy(), want, err_msg="eager")
    for backend in harness.BACKENDS:
        got = md.compile(
            lambda x: md.dropout(key, x, rate, [md.Dim("d", 8)]), harness.mesh("data4_model2"), layout, backend=backend
        )(x)
        np.testing.assert_array_equal(got.numpy(), want, err_msg=backend)


def test_dropout_noise_shape_shares_the_draw():
    # noise_shape [d, batch]: one draw per (batch, d), the same for every seq position.
    key, rate = jax.random.key(5), 0.5
    m, layout = harness.mesh("data4_model2"), {"seq": "data", "d": "model"}
    x = _ones_x(m, layout, {"batch": 2, "seq": 8, "d": 4})
    got = md.compile(lambda x: md.dropout(key, x, rate, [md.Dim("d", 4), md.Dim("batch", 2)]), m, layout)(x).numpy()
    keep = np.asarray(jax.random.uniform(key, (4, 2))) >= rate  # [d, batch]
    np.testing.assert_array_equal(got, np.broadcast_to((keep.T * 2.0)[:, None, :], (2, 8, 4)))
    assert np.all(got == got[:, :1, :])


def test_dropout_rate_zero_is_the_identity_and_bad_rates_raise():
    key = jax.random.key(0)
    x = harness.rand(np.random.default_rng(0), {"batch": 8, "d": 4})
    assert md.dropout(key, x, 0.0) is x
    m, layout = harness.mesh("x8"), {"batch": "x"}
    assert harness.check(lambda x: md.dropout(key, x, 0.0), [x], lambda x: x, m, layout)
    for rate in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError):
            md.dropout(key, x, rate)


@pytest.mark.parametrize(
    ("mesh", "layout"),
    [
        ("x8", {"a": "x"}),
        ("data4_model2", {"a": ("data", "model")}),
        ("a2_b2_c2", {"a": ("c", "b"), "b": "a"}),
    ],
)
def test_constants_build_their_blocks_without_communication(mesh, layout):
    m = harness.mesh(mesh)
    dims = harness.dims({"a": 8, "b": 2})

    def fn():
        return md.zeros(dims, jnp.int32), md.ones(dims), md.full(dims, -7.0, jnp.bfloat16)

    for backend in harness.BACKENDS:
        z, o, f = md.compile(fn, m, layout, backend=backend)()
        np.testing.assert_array_equal(z.numpy(), np.zeros((8, 2), np.int32))
        assert z.dtype == jnp.int32 and o.dtype == jnp.float32 and f.dtype == jnp.bfloat16
        np.testing.assert_array_equal(o.numpy(), np.ones((8, 2), np.float32))
        np.testing.assert_array_equal(f.numpy().astype(np.float32), np.full((8, 2), -7.0, np.float32))
        for t in (z, o, f):
            harness.assert_laid_out(t, md.Layout(layout), m, backend)
    assert harness.assert_explain_matches_hlo(fn, m, layout, []) == {}
