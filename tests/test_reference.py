"""The references themselves, on extreme inputs: finite where the function is, and right.

A reference that overflows (``1 / (1 + exp(-a))`` at ``a = -100`` in float32 has a NaN gradient)
fails the test that meets it, whatever meshdsl does, so the references are checked here against
an oracle that cannot overflow: the same functions in Python's ``decimal`` at 60 digits, with
exponents up to 10**18 (an ``exp`` is only taken of a non-positive number, so nothing overflows). Forward
values are checked in numpy (float64, as the
harness runs them), derivatives in jax.numpy (float32, under ``jax.grad``, as the harness runs
them).
"""

from decimal import MAX_EMAX, MIN_EMIN, Decimal, getcontext

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as R
from reference import Named

getcontext().prec, getcontext().Emax, getcontext().Emin = 60, MAX_EMAX, MIN_EMIN
EXTREME = [-1e30, -1e4, -100.0, -50.0, -10.5, -10.0, -3.0, -1e-30, 0.0, 1e-30, 0.5, 10.0, 10.5, 50.0, 100.0, 1e4, 1e30]
"""Inputs from far beyond float32's exp range to zero, both sides of gelu's linear switch (10)."""
C = Decimal(2 / np.pi).sqrt()


def _tanh(u: Decimal) -> Decimal:
    e = (-2 * abs(u)).exp()
    t = (1 - e) / (1 + e)
    return t if u >= 0 else -t


def _sigmoid(a: Decimal) -> Decimal:
    return 1 / (1 + (-a).exp()) if a >= 0 else a.exp() / (1 + a.exp())


def _softplus(a: Decimal) -> Decimal:
    return a + (1 + (-a).exp()).ln() if a > 0 else (1 + a.exp()).ln()


def _gelu(a: Decimal) -> Decimal:
    return a / 2 * (1 + _tanh(C * (a + Decimal("0.044715") * a**3)))


def _gelu_grad(a: Decimal) -> Decimal:
    t = _tanh(C * (a + Decimal("0.044715") * a**3))
    return (1 + t) / 2 + a / 2 * (1 - t * t) * C * (1 + 3 * Decimal("0.044715") * a * a)


ELEMENTWISE = {
    # name: (reference, oracle value, oracle derivative)
    "sigmoid": (R.sigmoid, _sigmoid, lambda a: _sigmoid(a) * (1 - _sigmoid(a))),
    "softplus": (R.softplus, _softplus, _sigmoid),
    "log_sigmoid": (R.log_sigmoid, lambda a: -_softplus(-a), lambda a: _sigmoid(-a)),
    "gelu": (R.gelu, _gelu, _gelu_grad),
}


def _close(got: np.ndarray, want: list[Decimal], rtol: float, atol: float, what: str) -> None:
    want_f = np.array([float(w) for w in want])
    assert np.all(np.isfinite(got)), f"{what}: not finite at {np.array(EXTREME)[~np.isfinite(got)]}"
    np.testing.assert_allclose(got, want_f, rtol=rtol, atol=atol, err_msg=what)


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_elementwise_reference_is_finite_and_right_on_extreme_inputs(name):
    ref, value, derivative = ELEMENTWISE[name]
    exact = [Decimal(a) for a in EXTREME]
    forward = ref(Named(np.array(EXTREME, np.float64), "n")).array
    _close(forward, [value(a) for a in exact], 1e-12, 1e-15, f"{name} forward (numpy float64)")

    # Inputs float32 can hold; the derivative as the harness takes it: jax.grad in float32.
    small = np.array([a for a in EXTREME if abs(a) < 3e38], np.float32)
    grad = jax.grad(lambda a: jnp.sum(ref(Named(a, "n")).array))(jnp.asarray(small))
    _close(
        np.asarray(grad), [derivative(Decimal(float(a))) for a in small], 1e-5, 1e-6, f"{name} derivative (jax float32)"
    )


ROWS = [
    [1e30, -1e30, 0.0],
    [1e4, 1e4, -1e4],
    [-1e4, -1e4 + 1, -1e4 + 2],
    [88.0, 89.0, 90.0],
    [-104.0, -200.0, 0.0],
]
"""Rows whose exp overflows or underflows float32 (and float64 for 1e30, 1e4)."""


def _logsumexp(row: list[float]) -> Decimal:
    top = Decimal(max(row))
    return top + sum((Decimal(v) - top).exp() for v in row).ln()


def _softmax(row: list[float]) -> list[Decimal]:
    top = Decimal(max(row))
    total = sum((Decimal(v) - top).exp() for v in row)
    return [(Decimal(v) - top).exp() / total for v in row]


@pytest.mark.parametrize("row", ROWS, ids=[str(r) for r in ROWS])
def test_softmax_family_reference_is_finite_and_right_on_extreme_inputs(row):
    x = Named(np.array([row]), "b n")
    probs = _softmax(row)
    scale = 1e-12 * max(1.0, *map(abs, row))  # the harness's tolerance is relative to the largest value too
    _close(R.logsumexp(x, "n").array.ravel(), [_logsumexp(row)], 1e-12, scale, "logsumexp forward")
    _close(R.softmax(x, "n").array.ravel(), probs, 1e-12, 1e-15, "softmax forward")
    _close(
        R.log_softmax(x, "n").array.ravel(),
        [Decimal(v) - _logsumexp(row) for v in row],
        1e-12,
        scale,
        "log_softmax forward",
    )

    # d logsumexp / dx = softmax; d sum(c * softmax) / dx = s * (c - sum(s c)).
    c = [1.0, -2.0, 0.5]
    a = jnp.asarray(np.array([row], np.float32))
    g_lse = jax.grad(lambda v: jnp.sum(R.logsumexp(Named(v, "b n"), "n").array))(a)
    _close(np.asarray(g_lse).ravel(), probs, 1e-5, 1e-6, "logsumexp derivative")
    g_sm = jax.grad(lambda v: jnp.sum(R.softmax(Named(v, "b n"), "n").array * jnp.asarray(c)))(a)
    weighted = sum(p * Decimal(ci) for p, ci in zip(probs, c))
    _close(
        np.asarray(g_sm).ravel(),
        [p * (Decimal(ci) - weighted) for p, ci in zip(probs, c)],
        1e-5,
        1e-6,
        "softmax derivative",
    )


def test_softmax_family_reference_of_masked_rows_is_jax_nn():
    """A fully masked row (-inf) and a half-masked one: the references give what jax.nn gives
    (logsumexp -inf, softmax and log_softmax nan on the masked row), values and gradients."""
    a = np.array([[-np.inf] * 4, [1.0, -np.inf, 0.5, -np.inf]])
    x = Named(a, "b n")
    for name in ("logsumexp", "softmax", "log_softmax"):
        with harness.float64_jax():
            want = np.asarray(getattr(jax.nn, name)(jnp.asarray(a), axis=1))
        np.testing.assert_allclose(getattr(R, name)(x, "n").array, want, rtol=1e-12, err_msg=name)
    keep = np.isfinite(a[1])

    def lse(v, ref):
        return jnp.sum(ref(jnp.where(keep, v, -jnp.inf)) * jnp.array([1.0]))

    v = jnp.asarray(np.where(keep, a[1], 0.0)[None], jnp.float32)
    want = jax.grad(lse)(v, lambda u: jax.nn.logsumexp(u, axis=1))
    got = jax.grad(lse)(v, lambda u: R.logsumexp(Named(u, "b n"), "n").array)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_take_along_and_conv2d_references_against_loops():
    # take_along: out[b, c] = x[b, i[b], c] (i broadcast over c), zero where i is outside [0, n).
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 2))
    i = np.array([-1, 2, 5])
    got = R.take_along(Named(x, "b n c"), Named(i, "b"), "n")
    assert got.names == ("b", "c")
    want = np.array([[x[b, i[b], c] if 0 <= i[b] < 5 else 0.0 for c in range(2)] for b in range(3)])
    np.testing.assert_array_equal(got.array, want)

    # conv2d, SAME zero padding: out[w, h, o] = sum over (u, v, c) of x[h + u - 1, w + v - 2, c] k[u, v, c, o].
    a = rng.standard_normal((4, 3, 2))  # [w, h, c]
    k = rng.standard_normal((3, 5, 2, 2))  # [kh, kw, c, o]
    out = R.conv2d(Named(a, "w h c"), Named(k, "kh kw c o"), "h", "w", "c", "o", "kh", "kw")
    assert out.names == ("w", "h", "o")
    want = np.zeros((4, 3, 2))
    for w, h, o, u, v, c in np.ndindex(4, 3, 2, 3, 5, 2):
        if 0 <= h + u - 1 < 3 and 0 <= w + v - 2 < 4:
            want[w, h, o] += a[w + v - 2, h + u - 1, c] * k[u, v, c, o]
    np.testing.assert_allclose(out.array, want, rtol=1e-12, atol=1e-12)
