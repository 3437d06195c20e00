"""Compressed gradient sums (``grad_reduce_dtype`` float16 / bfloat16 / float8_e4m3fn / float8_e5m2).

References are numpy with ml_dtypes (the formats' own rounding), independent of meshdsl: each
device's gradient scaled by the shared scale and rounded to the format, the parts summed in
float32 and the sum rounded once more, then scaled back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import meshdsl as md
from meshdsl import compression
from meshdsl.analysis import hlo
from meshdsl.collectives import Collective, bytes_moved

N = 4
D = 26  # not a multiple of N: the all-to-all pads it to 28
SCALED = ("float16", "float8_e4m3fn", "float8_e5m2")


@pytest.fixture(scope="module")
def mesh() -> md.Mesh:
    return md.Mesh({"data": N}, jax.devices()[:N])


def _fn(w: md.Tensor, x: md.Tensor) -> md.Tensor:
    """sum(w * x): the gradient of ``w`` on each device is its own row of ``x`` (one row per device)."""
    return md.reduce_sum(w * x)


def _grad(mesh: md.Mesh, dtype: str, rows: np.ndarray) -> np.ndarray:
    compiled = md.compile(_fn, mesh, "batch:data", grad_reduce_dtype=dtype)
    w = md.tensor(np.zeros(D, np.float32), ["d"])
    x = md.tensor(rows, ["batch", "d"])
    return np.asarray(jax.grad(lambda w: compiled(w, x).array)(w).numpy())


def _reference(rows: np.ndarray, dtype: str) -> np.ndarray:
    """The compressed sum of ``rows`` (one per device), in numpy with ml_dtypes."""
    dt = np.dtype(getattr(ml_dtypes, dtype) if dtype.startswith("float8") else dtype)
    n, top = len(rows), float(ml_dtypes.finfo(dt).max)
    target = np.array(top / n).astype(dt)
    if float(target) > top / n:
        target = np.nextafter(target, np.array(0, dt))
    s = np.float32(np.max(np.abs(rows)) / np.float32(target))
    parts = (rows / s).astype(dt).astype(np.float32)
    return (parts.sum(axis=0, dtype=np.float32).astype(dt).astype(np.float32) * s).astype(np.float32)


def _bound(rows: np.ndarray, dtype: str) -> np.ndarray:
    """Worst error of the compressed sum against the exact one: half an ulp of the format at the largest
    value, per part (``n`` of them) and once for the sum (relative eps of the format, times the scale)."""
    dt = np.dtype(getattr(ml_dtypes, dtype) if dtype.startswith("float8") else dtype)
    eps = float(ml_dtypes.finfo(dt).eps)
    return (len(rows) + 1) * eps * np.max(np.abs(rows)) * len(rows)


@pytest.mark.parametrize("dtype", SCALED)
@pytest.mark.parametrize("magnitude", [1.0, 6e4])
def test_compressed_sum_equals_numpy_rounding(mesh, dtype, magnitude):
    """The gradient summed over data=4 equals numpy's sum of the same values rounded as the format
    rounds, and the exact sum within the format's bound; with entries near float16's maximum (6e4,
    whose sum of 4 overflows float16 and e5m2 unscaled) nothing overflows."""
    rows = (np.random.default_rng(3).standard_normal((N, D)) * magnitude).astype(np.float32)
    got = _grad(mesh, dtype, rows)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, _reference(rows, dtype), rtol=1e-6, atol=1e-6 * magnitude)
    exact = rows.astype(np.float64).sum(axis=0)
    assert np.max(np.abs(got - exact)) <= _bound(rows, dtype)


def test_bfloat16_sum_is_a_cast_sum(mesh):
    """bfloat16 (float32's range) is summed unscaled: within bf16's rounding of the exact sum."""
    rows = np.random.default_rng(4).standard_normal((N, D)).astype(np.float32)
    got = _grad(mesh, "bfloat16", rows)
    np.testing.assert_allclose(got, rows.sum(axis=0), atol=_bound(rows, "bfloat16"))


def test_zero_gradient_stays_zero(mesh):
    """A zero gradient (max-abs 0) gives scale 1, not a division by zero."""
    for dtype in SCALED:
        assert np.array_equal(_grad(mesh, dtype, np.zeros((N, D), np.float32)), np.zeros(D))


def _grad_fn(w: md.Tensor, x: md.Tensor) -> md.Tensor:
    return jax.grad(lambda w: md.reduce_sum(w * x).array)(w)


@pytest.mark.parametrize("x_enters", ["as an argument", "closed over"])
@pytest.mark.parametrize("dtype", [None, *compression.DTYPES])
def test_bytes_hlo_equal_explain_equal_formula(mesh, dtype, x_enters):
    """The gradient sum's collectives in the compiled program equal md.explain's, and their bytes the
    formula: a ring all-reduce of the gradient in float32 (bfloat16: XLA on CPU widens the sum to
    float32; priced as on a GPU it is 2 bytes an element), and for the scaled formats the scale's
    4-byte all-reduce plus an all-to-all and an all-gather of the (padded) gradient in the format.
    ``x`` closed over is a replicated constant the lowering slices to each device's rows: its
    gradient sum is compressed all the same (it was JAX's implicit float32 sum once), and equal to
    the argument's."""
    w = md.tensor(np.zeros(D, np.float32), ["d"])
    x = md.tensor(np.arange(N * D, dtype=np.float32).reshape(N, D) % 7, ["batch", "d"])
    fn, args = (_grad_fn, (w, x)) if x_enters == "as an argument" else (lambda w: _grad_fn(w, x), (w,))
    compiled = md.compile(fn, mesh, "batch:data", grad_reduce_dtype=dtype)
    np.testing.assert_array_equal(
        compiled(*args).numpy(), md.compile(_grad_fn, mesh, "batch:data", grad_reduce_dtype=dtype)(w, x).numpy()
    )
    np.testing.assert_allclose(compiled(*args).numpy(), x.numpy().sum(axis=0), rtol=0.2)
    from_hlo = hlo.summary(compiled.lower(*args).compile().as_text())
    explained = md.explain(fn, mesh, "batch:data", *args, grad_reduce_dtype=dtype)
    assert explained.summary() == from_hlo
    if compression.scaled(dtype):
        # the scale's pmax, AR(4) = 2 * 3/4 * 4, then 3/4 of the 28 padded elements each way
        formula = 6 + 2 * 3 / 4 * 28 * np.dtype(getattr(ml_dtypes, dtype, dtype)).itemsize
        assert formula == compression.sum_bytes(D, N, dtype)
        assert set(from_hlo) == {"all-reduce", "all-to-all", "all-gather"}
    else:
        formula = bytes_moved(Collective.ALL_REDUCE, 4 * D, 4 * D, N)
    assert explained.total_bytes == pytest.approx(formula)
    if dtype == "bfloat16":
        on_gpu = md.explain(fn, mesh, "batch:data", *args, grad_reduce_dtype=dtype, platform="gpu")
        assert on_gpu.total_bytes == pytest.approx(bytes_moved(Collective.ALL_REDUCE, 2 * D, 2 * D, N))
    if dtype in ("float8_e4m3fn", "float8_e5m2"):
        assert formula < bytes_moved(Collective.ALL_REDUCE, 2 * D, 2 * D, N)  # under a 16-bit sum's bytes


@pytest.mark.parametrize("dtype, tol", [("float16", 2e-3), ("float8_e4m3fn", 0.15)])
def test_scaled_sums_through_softmax_and_fsdp_gathers(dtype, tol):
    """A softmax (a custom JVP whose tangent sums must stay linear: summed in full precision there),
    a replicated operand met by split ones (u: an all-reduce) and a stored split parameter (w, FSDP:
    a reduce-scatter) on a (2, 2, 2) mesh: gradients equal jax.grad's on global arrays within the
    format's rounding, relative to the largest gradient entry."""
    rng = np.random.default_rng(9)
    mesh = md.Mesh({"a": 2, "b": 2, "c": 2})
    x = md.tensor(rng.standard_normal((8, 8)).astype(np.float32), ["rows", "cols"])
    c = md.tensor(rng.standard_normal((8, 8)).astype(np.float32), ["rows", "cols"])
    w = md.tensor(rng.standard_normal(8).astype(np.float32), ["cols"])
    u = md.tensor(rng.standard_normal(8).astype(np.float32), ["cols"])

    def fn(x, w, u):
        return md.reduce_sum(md.softmax(x * w + u, "cols") * c)

    compiled = md.compile(fn, mesh, "rows:a; cols:b", in_layouts=[None, "cols:(b c)", None], grad_reduce_dtype=dtype)
    grads = jax.grad(lambda *ts: compiled(*ts).array, argnums=(0, 1, 2))(x, w, u)

    def ref(x, w, u):
        return jnp.sum(jax.nn.softmax(x * w + u, axis=1) * jnp.asarray(c.numpy()))

    want = jax.grad(ref, argnums=(0, 1, 2))(*(jnp.asarray(t.numpy()) for t in (x, w, u)))
    for name, g, v in zip("xwu", grads, want, strict=True):
        v = np.asarray(v)
        np.testing.assert_allclose(g.numpy(), v, atol=tol * np.max(np.abs(v)), err_msg=name)


@pytest.mark.parametrize("dtype", compression.DTYPES)
def test_training_step_bytes_equal_the_analytic_minimum(dtype):
    """The shipped MLP's training step on data=4: the compiled program's collectives equal md.explain's
    (priced for CPU) and, priced for a GPU, the analytic minimum (bench's formula) to the byte."""
    from meshdsl.bench import analytic
    from meshdsl.model.loader import build_model
    from meshdsl.train import optim
    from meshdsl.train.step import Trainer

    layout = md.Layout("batch:data", mesh_axes={"data": N})
    mesh = layout.mesh(jax.devices()[:N])
    model, optimizer = build_model("mlp", "tiny"), optim.make("sgd")
    trainer = Trainer(model, optimizer, mesh, layout, grad_reduce_dtype=dtype)
    state = trainer.init(jax.random.key_data(jax.random.key(0)))
    key = jax.random.key_data(jax.random.key(1))
    from_hlo = hlo.summary(trainer.step.lower(state, key).compile().as_text(), num_devices=N)
    assert trainer.explain(state, key).summary() == from_hlo
    minimum = analytic.minimum_bytes(model, state["params"], mesh, layout, optimizer, dtype)
    assert trainer.explain(state, key, platform="gpu").total_bytes == pytest.approx(minimum)


# ---- error feedback ---------------------------------------------------------------------------------


class _Linear:
    """loss = sum(w * x) / batch over a fixed batch: every step's gradient is the same (x's rows), so
    SGD with step size 1 leaves ``w_T = w_0 - sum_t compressed_sum_t`` and the drift is exact."""

    def init(self, key):
        return {"w": md.zeros([md.Dim("d", D)])}

    def loss(self, params, batch):
        return md.reduce_mean(md.reduce_sum(params["w"] * batch["x"], "d"))


def _batch(rows: np.ndarray) -> dict[str, md.Tensor]:
    return {"x": md.tensor(rows * len(rows), ["batch", "d"])}


def _drift(dtype: str, feedback: bool, steps: int, rows: np.ndarray) -> tuple[np.ndarray, dict]:
    from meshdsl.train import optim
    from meshdsl.train.step import Trainer

    layout = md.Layout("batch:data", mesh_axes={"data": N})
    mesh = layout.mesh(jax.devices()[:N])
    trainer = Trainer(
        _Linear(), optim.sgd(1.0), mesh, layout, grad_reduce_dtype=dtype, error_feedback=feedback, donate=False
    )
    state = trainer.init(jax.random.key_data(jax.random.key(0)))
    for _ in range(steps):
        state, _ = trainer.step(state, _batch(rows))
    return -state["params"]["w"].numpy() - steps * rows.astype(np.float64).sum(axis=0), state


@pytest.mark.parametrize("dtype", ["float8_e5m2", "float8_e4m3fn", "float16"])
def test_error_feedback_keeps_the_accumulated_error_bounded(dtype):
    """Over 12 steps of the same gradients, the weights drift from the exact sums by the devices'
    last residuals only (one step's rounding, whatever the step count) with error feedback; without
    it, by every step's rounding: twelve times as much for this fixed bias."""
    rows = np.random.default_rng(5).standard_normal((N, D)).astype(np.float32)
    one_step = _bound(rows, dtype)
    with_feedback, state = _drift(dtype, True, 12, rows)
    without, _ = _drift(dtype, False, 12, rows)
    residuals = state["error_feedback"]["w"].numpy()
    assert residuals.shape == (N, D)
    # what the weights lack is exactly what the devices still carry
    np.testing.assert_allclose(with_feedback, -residuals.sum(axis=0), atol=1e-4 * one_step)
    assert np.max(np.abs(with_feedback)) <= one_step
    assert np.max(np.abs(without)) > 4 * np.max(np.abs(with_feedback))


def test_error_feedback_resumes_bit_exactly_from_a_checkpoint(tmp_path):
    """The residuals are state: saved and restored with the rest, a resumed run equals an unbroken one."""
    from meshdsl.train import optim
    from meshdsl.train.step import Trainer

    rows = np.random.default_rng(6).standard_normal((N, D)).astype(np.float32)
    layout = md.Layout("batch:data", mesh_axes={"data": N})
    mesh = layout.mesh(jax.devices()[:N])
    trainer = Trainer(
        _Linear(),
        optim.sgd(0.5),
        mesh,
        layout,
        grad_reduce_dtype="float8_e4m3fn",
        error_feedback=True,
        donate=False,
    )
    state = trainer.init(jax.random.key_data(jax.random.key(0)))
    for _ in range(2):
        state, _ = trainer.step(state, _batch(rows))
    md.checkpoint.save(tmp_path / "ckpt", state)
    restored, _ = md.checkpoint.restore(tmp_path / "ckpt", mesh, layout, like=trainer.abstract_state())
    unbroken, resumed = state, restored
    for _ in range(2):
        unbroken, _ = trainer.step(unbroken, _batch(rows))
        resumed, _ = trainer.step(resumed, _batch(rows))
    for name in ("params", "error_feedback"):
        assert np.array_equal(unbroken[name]["w"].numpy(), resumed[name]["w"].numpy()), name
    assert np.any(unbroken["error_feedback"]["w"].numpy() != 0)


def test_error_feedback_without_a_compressed_sum_is_one_line():
    from meshdsl.train import optim
    from meshdsl.train.step import Trainer

    layout = md.Layout("batch:data", mesh_axes={"data": N})
    with pytest.raises(md.ConfigError, match=r"^--grad-error-feedback: there is no compressed sum"):
        Trainer(_Linear(), optim.sgd(1.0), layout.mesh(jax.devices()[:N]), layout, error_feedback=True)


def test_cli_refuses_error_feedback_without_a_compressed_sum(capsys, tmp_path, monkeypatch):
    """``meshdsl train --grad-error-feedback`` without ``--grad-reduce-dtype``: one line before any work."""
    from meshdsl import cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "--model", "mlp", "--preset", "tiny", "--grad-error-feedback"]) == 2
    assert capsys.readouterr().err.strip() == (
        "meshdsl train: error: --grad-error-feedback: there is no compressed sum: give --grad-reduce-dtype"
    )
    assert not list(tmp_path.iterdir())
