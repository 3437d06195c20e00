"""Component-wise ops: every unary and binary op, broadcasting by dim name, comparisons, where,
casts and the Python operators, on drawn meshes, shapes and layouts.

Each drawn case compiles one function that returns many ops' results at once (the ops are
independent, so one program checks them all) and runs the full harness check: values against
numpy on both backends, gradients against jax.numpy on one device, result and gradient
shardings, and md.explain against the compiled HLO (no collective is expected from a
component-wise op on operands that share a layout, which explain == HLO also covers).
"""

import harness
import jax.numpy as jnp
import numpy as np
import pytest
import reference as R
import strategies as S
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import meshdsl as md

# ---- unary ops: (md op, reference, input kind) ----

UNARY = {
    "exp": (md.exp, R.exp, "normal"),
    "tanh": (md.tanh, R.tanh, "normal"),
    "sigmoid": (md.sigmoid, R.sigmoid, "normal"),
    "softplus": (md.softplus, R.softplus, "normal"),
    "log_sigmoid": (md.log_sigmoid, R.log_sigmoid, "normal"),
    "relu": (md.relu, R.relu, "normal"),
    "gelu": (md.gelu, R.gelu, "normal"),
    "square": (md.square, R.square, "normal"),
    "abs": (md.abs, R.abs, "normal"),
    "negative": (md.negative, R.negative, "normal"),
    "log": (md.log, R.log, "positive"),
    "sqrt": (md.sqrt, R.sqrt, "positive"),
    "rsqrt": (md.rsqrt, R.rsqrt, "positive"),
    "operator -x": (lambda x: -x, R.negative, "normal"),
    "operator abs(x)": (lambda x: abs(x), R.abs, "normal"),
}


def unary_all(x, p):
    return {name: op(p if kind == "positive" else x) for name, (op, _, kind) in UNARY.items()}


def unary_all_ref(x, p):
    return {name: ref(p if kind == "positive" else x) for name, (_, ref, kind) in UNARY.items()}


@settings(max_examples=S.examples(12))
@given(mesh=S.meshes(), pool=S.dim_pool(3), data=st.data(), rng=S.rngs())
def test_unary_ops(mesh, pool, data, rng):
    shape = data.draw(S.sub_shape(pool), label="shape")
    layout = data.draw(S.layouts(mesh, pool), label="layout")
    x, p = harness.rand(rng, shape), harness.rand(rng, shape, "positive")
    assume(
        harness.check(
            unary_all, [x, p], unary_all_ref, mesh, layout, backends=data.draw(S.backends(), label="backends")
        )
    )


# ---- binary ops with broadcasting by name ----


def binary_all(x, y, q, i, j):
    """x, y: normal; q: positive, with y's dims; i, j: float32 small integers with x's and y's dims."""
    return {
        "add": md.add(x, y),
        "subtract": md.subtract(x, y),
        "multiply": md.multiply(x, y),
        "divide": md.divide(x, q),
        "power": md.power(q, x),
        "maximum": md.maximum(x, y),
        "minimum": md.minimum(x, y),
        "operators": (x + y) * 2.0 - y / q + x**2 - 3.0 / q + (1.0 - x),
        "scalar power": md.power(q, 3.0),
        "where": md.where(md.greater(x, y), x * 2.0, y),
        "where scalar": md.where(x < 0.0, 0.0, x),
        "stop_gradient": md.stop_gradient(x) * y,
        "cast mask": md.cast(md.less(x, y), jnp.float32) * x,
        "less": md.less(i, j),
        "less_equal": md.less_equal(i, j),
        "greater": md.greater(i, j),
        "greater_equal": md.greater_equal(i, j),
        "equal": md.equal(i, j),
        "not_equal": md.not_equal(i, j),
        "operator ==": i == j,
        "operator <": i < j,
        "logical": md.logical_or(md.logical_and(i < j, x > 0.0), md.logical_not(i == j)),
        "operators &|~": ((i <= j) & (x >= 0.0)) | ~(i != j),
        "cast int": md.cast(i, jnp.int32) + md.cast(j, jnp.int32),
    }


def binary_all_ref(x, y, q, i, j):
    return {
        "add": x + y,
        "subtract": x - y,
        "multiply": x * y,
        "divide": x / q,
        "power": R.power(q, x),
        "maximum": R.maximum(x, y),
        "minimum": R.minimum(x, y),
        "operators": (x + y) * 2.0 - y / q + x**2 - 3.0 / q + (1.0 - x),
        "scalar power": R.power(q, 3.0),
        "where": R.where(R.greater(x, y), x * 2.0, y),
        "where scalar": R.where(R.less(x, 0.0), 0.0, x),
        "stop_gradient": R.stop_gradient(x) * y,
        "cast mask": R.cast(R.less(x, y), np.float32) * x,
        "less": R.less(i, j),
        "less_equal": R.less_equal(i, j),
        "greater": R.greater(i, j),
        "greater_equal": R.greater_equal(i, j),
        "equal": R.equal(i, j),
        "not_equal": R.not_equal(i, j),
        "operator ==": R.equal(i, j),
        "operator <": R.less(i, j),
        "logical": R.logical_or(R.logical_and(R.less(i, j), R.greater(x, 0.0)), R.logical_not(R.equal(i, j))),
        "operators &|~": R.logical_or(
            R.logical_and(R.less_equal(i, j), R.greater_equal(x, 0.0)), R.logical_not(R.not_equal(i, j))
        ),
        "cast int": R.cast(i, np.int32) + R.cast(j, np.int32),
    }


@settings(max_examples=S.examples(10))
@given(mesh=S.meshes(), pool=S.dim_pool(4), data=st.data(), rng=S.rngs())
def test_binary_ops_broadcast_by_name(mesh, pool, data, rng):
    # x and y draw their dims from one pool: they may share some, all or none (outer product).
    xs = data.draw(S.sub_shape(pool), label="x dims")
    ys = data.draw(S.sub_shape(pool), label="y dims")
    layout = data.draw(S.layouts(mesh, pool), label="layout")
    args = [
        harness.rand(rng, xs),
        harness.rand(rng, ys),
        harness.rand(rng, ys, "positive"),
        harness.rand(rng, xs, "int"),
        harness.rand(rng, ys, "int"),
    ]
    assume(
        harness.check(
            binary_all, args, binary_all_ref, mesh, layout, backends=data.draw(S.backends(), label="backends")
        )
    )


def test_integer_tensors_and_broadcast_order():
    # Deterministic: int32 arithmetic is exact, and the result's dims are the union of the
    # operands' dims in order of first appearance (x's [a, b], then y's new c).
    rng = np.random.default_rng(0)
    x = harness.rand(rng, {"a": 4, "b": 8}, "int32")
    y = harness.rand(rng, {"c": 2, "b": 8}, "int32")
    out = x * y + x
    assert out.names == ("a", "b", "c")
    want = x.numpy()[:, :, None] * y.numpy().T[None, :, :] + x.numpy()[:, :, None]
    np.testing.assert_array_equal(out.numpy(), want)
    assert out.dtype == jnp.int32
    assert harness.check(
        lambda x, y: x * y + x,
        [x, y],
        lambda x, y: x * y + x,
        harness.mesh("data4_model2"),
        {"b": "data", "c": "model"},
    )


def test_same_name_different_size_is_a_shape_error():
    rng = np.random.default_rng(0)
    x = harness.rand(rng, {"batch": 4, "d": 8})
    y = harness.rand(rng, {"d": 6})
    with pytest.raises(md.ShapeError, match=r"dim d has size 8 in one operand and 6 in another"):
        x + y


def test_unnamed_array_operand_is_a_shape_error():
    x = harness.rand(np.random.default_rng(0), {"d": 4})
    with pytest.raises(md.ShapeError, match="md.tensor"):
        md.add(x, np.ones(4, np.float32))
