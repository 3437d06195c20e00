"""md tensors as JAX citizens: pytrees, eager ops under jax.jit, jax.grad around and inside
md.compile, gradients laid out like the parameters, and ``x.numpy()`` as the global value.

The model is a two-layer MLP; its reference is the same MLP in jax.numpy on one device.
"""

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshdsl as md
from meshdsl.tensor import Tensor

LAYOUT = md.Layout({"batch": "data", "d_ff": "model"})
SIZES = {"batch": 8, "d_model": 4, "d_ff": 16}


@pytest.fixture(scope="module")
def mesh():
    return harness.mesh("data4_model2")


@pytest.fixture(scope="module")
def model():
    rng = np.random.default_rng(0)
    params = {
        "w1": harness.rand(rng, {"d_model": 4, "d_ff": 16}),
        "w2": harness.rand(rng, {"d_ff": 16, "d_model": 4}),
    }
    x = harness.rand(rng, {"batch": 8, "d_model": 4})
    return params, x


def loss_fn(params, x):
    h = md.relu(md.einsum(x, params["w1"], out=["batch", "d_ff"]))
    y = md.einsum(h, params["w2"], out=["batch", "d_model"])
    return md.reduce_mean(md.square(y - x))


def ref_loss(params, x):
    h = jnp.maximum(x @ params["w1"], 0)
    return jnp.mean((h @ params["w2"] - x) ** 2)


def _numpy(tree):
    return jax.tree_util.tree_map(lambda t: t.numpy(), tree, is_leaf=lambda t: isinstance(t, Tensor))


def _ref_value_and_grad(params, x):
    on_one = lambda a: jax.device_put(a, jax.devices()[0])  # noqa: E731
    p = {k: on_one(v) for k, v in _numpy(params).items()}
    return jax.jit(jax.value_and_grad(ref_loss))(p, on_one(x.numpy()))


def _assert_grads(grads, params, want, mesh):
    assert set(grads) == set(params)
    for k in params:
        assert isinstance(grads[k], Tensor) and grads[k].shape == params[k].shape
        harness.assert_values_close(grads[k].numpy(), want[k], harness.GRAD_TOL, f"gradient of {k}")
        harness.assert_laid_out(grads[k], LAYOUT, mesh, f"gradient of {k}")


# ---- pytrees ----


def test_tensor_is_a_pytree_with_one_array_leaf():
    t = harness.rand(np.random.default_rng(1), {"a": 2, "b": 3})
    leaves, treedef = jax.tree_util.tree_flatten(t)
    assert len(leaves) == 1 and leaves[0] is t.array
    back = jax.tree_util.tree_unflatten(treedef, [leaves[0] * 2])
    assert isinstance(back, Tensor) and back.shape == t.shape
    np.testing.assert_array_equal(back.numpy(), t.numpy() * 2)
    [(path, _)] = jax.tree_util.tree_flatten_with_path(t)[0]
    assert jax.tree_util.keystr(path) == ".array"
    other = harness.rand(np.random.default_rng(1), {"a": 2, "c": 3})
    assert jax.tree_util.tree_structure(t) != jax.tree_util.tree_structure(other)  # names are static


def test_tree_map_over_nested_params(model):
    params, _ = model
    doubled = jax.tree_util.tree_map(lambda a: a * 2, {"layer": params, "n": jnp.ones(2)})
    assert isinstance(doubled["layer"]["w1"], Tensor)
    assert doubled["layer"]["w1"].names == ("d_model", "d_ff")
    np.testing.assert_array_equal(doubled["layer"]["w2"].numpy(), 2 * params["w2"].numpy())


# ---- jax transformations ----


def test_jax_jit_of_eager_md_ops(model):
    params, x = model
    out = jax.jit(loss_fn)(params, x)
    assert isinstance(out, Tensor) and out.names == ()
    want, _ = _ref_value_and_grad(params, x)
    harness.assert_values_close(out.numpy(), want)


def test_eager_ops_are_global(model):
    params, x = model
    h = md.einsum(x, params["w1"], out=["d_ff", "batch"])
    assert h.names == ("d_ff", "batch") and h.numpy().shape == (16, 8)
    harness.assert_values_close(h.numpy(), (x.numpy().astype(np.float64) @ params["w1"].numpy()).T)


@pytest.mark.parametrize("backend", harness.BACKENDS)
def test_numpy_of_a_compiled_result_is_the_global_value(model, mesh, backend):
    params, x = model
    fn = lambda x, w: md.einsum(x, w, out=["batch", "d_ff"])  # noqa: E731
    out = md.compile(fn, mesh, LAYOUT, backend=backend)(x, params["w1"])
    assert out.array.sharding.shard_shape((8, 16)) == (2, 8)  # split over data and model...
    assert out.numpy().shape == (8, 16)  # ...but .numpy() is the whole array
    harness.assert_values_close(out.numpy(), x.numpy().astype(np.float64) @ params["w1"].numpy())


@pytest.mark.parametrize("backend", harness.BACKENDS)
def test_grad_around_compiled_function(model, mesh, backend):
    params, x = model
    compiled = md.compile(loss_fn, mesh, LAYOUT, backend=backend)
    grads = jax.grad(lambda p: compiled(p, x).array)(params)
    _, want = _ref_value_and_grad(params, x)
    _assert_grads(grads, params, want, mesh)


@pytest.mark.parametrize("backend", harness.BACKENDS)
def test_value_and_grad_inside_compiled_function(model, mesh, backend):
    params, x = model

    def step(params, x):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(p, x).array)(params)
        new = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)  # an SGD step, leaf by leaf
        return loss, grads, new

    loss, grads, new = md.compile(step, mesh, LAYOUT, backend=backend)(params, x)
    want_loss, want = _ref_value_and_grad(params, x)
    harness.assert_values_close(loss, want_loss, what="loss")
    _assert_grads(grads, params, want, mesh)
    for k in params:
        assert isinstance(new[k], Tensor) and new[k].shape == params[k].shape
        harness.assert_values_close(new[k].numpy(), params[k].numpy() - 0.1 * np.asarray(want[k]), what=f"updated {k}")
        harness.assert_laid_out(new[k], LAYOUT, mesh, f"updated {k}")


def test_explain_matches_hlo_for_the_training_step(model, mesh):
    params, x = model

    def grads(params, x):
        return jax.grad(lambda p: loss_fn(p, x).array)(params)

    harness.assert_explain_matches_hlo(grads, mesh, LAYOUT, [params, x])


def test_plain_arrays_among_arguments_are_replicated(model, mesh):
    params, x = model
    fn = lambda x, scale: x * scale  # noqa: E731
    out = md.compile(fn, mesh, LAYOUT)(x, jnp.float32(3.0))
    harness.assert_values_close(out.numpy(), 3 * x.numpy())
