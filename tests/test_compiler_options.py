"""meshdsl compiles its programs on CPU without XLA:CPU's YNNPACK library fusions (meshdsl.runtime.compiler_options).

A library fusion fuses none of its producers, so XLA computes each operand into a buffer of its own,
broadcasts included; meshdsl's planner predicts the generic fusion XLA:GPU does. The checks compile
the same function with and without the option through plain ``jax.jit`` (the reference: XLA's own
HLO) and ask which of the two ``md.compile`` and bench's plain-JAX step build; the memory the option
saves is checked against the planner in ``test_planner.py`` (the remat rows at length 64).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import meshdsl as md
from meshdsl.bench import baselines
from meshdsl.measure.timing import compile_step
from meshdsl.model.loader import build_model
from meshdsl.runtime import compiler_options as options
from meshdsl.train import optim
from meshdsl.train.step import Trainer


def _norm_dot_grad(x: jax.Array, scale: jax.Array, w: jax.Array) -> jax.Array:
    """A layer norm's output into a matmul, differentiated: XLA:CPU gives the norm's pieces to YNNPACK."""

    def loss(x: jax.Array, scale: jax.Array, w: jax.Array) -> jax.Array:
        normed = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale
        return jnp.sum(jnp.tanh(normed @ w))

    return jax.grad(loss, argnums=(0, 1, 2))(x, scale, w)


def _args() -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    return (
        rng.normal(size=(64, 128)).astype(np.float32),
        np.ones(128, np.float32),
        rng.normal(size=(128, 96)).astype(np.float32),
    )


def test_md_compile_on_cpu_leaves_out_the_library_fusions_that_plain_jit_makes() -> None:
    args = _args()
    plain = jax.jit(_norm_dot_grad).lower(*args).compile().as_text()
    without = jax.jit(_norm_dot_grad, compiler_options=options.NO_LIBRARY_FUSIONS).lower(*args).compile().as_text()
    assert "ynn_fusion" in plain and "ynn_fusion" not in without  # the option is what removes them

    mesh = md.Mesh({"data": 1})
    compiled = md.compile(lambda x, s, w: _norm_dot_grad(x, s, w), mesh, "batch:data")
    assert "ynn_fusion" not in compiled.lower(*args).compile().as_text()
    want = jax.jit(_norm_dot_grad)(*args)
    # at top level, and traced into a user's jit and grad (where XLA refuses options on the inner jit)
    nested = jax.jit(lambda *a: compiled(*a))(*args)
    summed = jax.grad(lambda x: sum(jnp.sum(g) for g in compiled(x, *args[1:])))(args[0])
    want_summed = jax.grad(lambda x: sum(jnp.sum(g) for g in _norm_dot_grad(x, *args[1:])))(args[0])
    for got, ref in [*zip(compiled(*args), want, strict=True), *zip(nested, want, strict=True), (summed, want_summed)]:
        ref = np.asarray(ref)  # float32 sums in another order: to a few ulps of the largest entry
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=2e-5 * np.abs(ref).max())


def test_options_are_for_cpu_only_and_dropped_when_this_jaxlib_refuses_them(monkeypatch) -> None:
    assert options.compiler_options("cpu") == options.NO_LIBRARY_FUSIONS
    assert options.compiler_options("gpu") == {} and options.compiler_options("tpu") == {}
    monkeypatch.setattr(options, "NO_LIBRARY_FUSIONS", {"xla_cpu_no_such_option_of_meshdsl": ""})
    assert options.compiler_options("cpu") == {}  # a later jaxlib without the option compiles as before


def test_bench_compiles_its_plain_jax_step_as_it_compiles_meshdsls(monkeypatch) -> None:
    """bench's ``÷ jax`` compares two steps compiled alike: the plain-JAX step has no library fusion either,
    where the same step compiled without the option has (a transformer large enough for XLA:CPU to use them)."""
    layout = md.Layout("batch:data", mesh_axes={"data": 4})
    model = build_model("transformer", "tiny", length=64, d_model=128, d_ff=256, d_kv=16)
    step = compile_step(Trainer(model, optim.make("adamw"), layout.mesh(jax.devices()[:4]), layout), seed=0)
    plain = baselines.baseline(step)
    assert plain.losses_match and plain.step is not None
    assert "ynn_fusion" not in plain.step.compiled.as_text()
    monkeypatch.setattr(baselines, "compiler_options", lambda platform: {})
    assert "ynn_fusion" in baselines.baseline(step).step.compiled.as_text()
