"""The training loop a person watches: schedules, gradient accumulation, evaluation, progress and logs.

References are independent: optax's own schedules written out by formula, and plain-JAX losses and
gradients of the whole batch (``jax.grad`` of a jax.numpy function on global arrays).
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshdsl as md
import meshdsl.models.mlp as mlp
from meshdsl.train import optim
from meshdsl.train.step import Trainer


# ---- schedules ---------------------------------------------------------------------------------


def _expected(kind: str, step: int, steps: int, warmup: int, ratio: float) -> float:
    """The multiplier of ``step`` written out by formula (optax's conventions: warmup from 0)."""
    if step < warmup:
        return step / warmup
    t = step - warmup
    if kind == "constant":
        return 1.0
    if kind == "cosine":
        return ratio + (1 - ratio) * 0.5 * (1 + math.cos(math.pi * min(t, steps - warmup) / (steps - warmup)))
    if kind == "linear":
        return 1 + (ratio - 1) * min(t, steps - warmup) / (steps - warmup)
    decay = max(1, round(0.2 * (steps - warmup)))
    start = steps - decay
    return 1.0 if step < start else 1 + (ratio - 1) * min(step - start, decay) / decay


@pytest.mark.parametrize("kind", optim.SCHEDULES)
def test_schedules_follow_their_formulas(kind):
    f = optim.schedule(kind, 50, 10, 0.1)
    got = [float(f(s)) for s in range(51)]
    want = [_expected(kind, s, 50, 10, 0.1) for s in range(51)]
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert got[0] == 0.0 and got[10] == pytest.approx(1.0)


@pytest.mark.parametrize(
    "args, message",
    [
        (("cosine", 10, 10, 0.0), "--warmup-steps 10"),
        (("cosine", 10, -1, 0.0), "--warmup-steps -1"),
        (("cosine", 10, 0, 1.5), "--min-lr-ratio 1.5"),
        (("cosine", 10, 0, float("nan")), "--min-lr-ratio nan"),
        (("step", 10, 0, 0.0), "--lr-schedule 'step'"),
    ],
)
def test_bad_schedules_are_named(args, message):
    with pytest.raises(md.ConfigError, match=message):
        optim.schedule(*args)


@pytest.mark.parametrize("name", ["sgd", "adamw", "adafactor"])
def test_the_optimizer_steps_with_the_scheduled_rate(name):
    """SGD's update is exactly -lr(step) * grad; every optimizer reports the rate it used."""
    f = optim.schedule("linear", 8, 2, 0.25)
    opt = optim.make(name, f, **({} if name == "adafactor" else {"learning_rate": 0.5}))
    for step in range(8):
        base = 0.5 if name != "adafactor" else min(1e-2, 1 / math.sqrt(step + 1))
        assert opt.learning_rate_at(step) == pytest.approx(base * _expected("linear", step, 8, 2, 0.25), rel=1e-6)
    sgd = optim.make("sgd", f, learning_rate=0.5)
    p = {"w": md.tensor(jnp.ones(3), ["x"])}
    g = {"w": md.tensor(jnp.asarray([1.0, 2.0, 3.0]), ["x"])}
    state = sgd.init(p)
    for step in range(4):
        new, state = sgd.update(g, state, p, jnp.asarray(step))
        np.testing.assert_allclose(new["w"].numpy(), 1 - 0.5 * _expected("linear", step, 8, 2, 0.25) * np.array([1, 2, 3]), rtol=1e-6)


# ---- gradient accumulation -----------------------------------------------------------------------


class Regression:
    """A user's model without pipeline parts: ``pred = x . w + b``, mean squared error per example.
    ``loss_dims`` names its output dims by the model's ``Dim`` (sized as the whole batch) rather than by name."""

    def __init__(self, batch: int = 16, features: int = 6, loss_dims: bool = False):
        self.batch_dim, self.features = md.Dim("batch", batch), md.Dim("features", features)
        self.loss_dims = loss_dims

    def init(self, key):
        return {"w": md.random.normal(key, [self.features]), "b": md.zeros([])}

    def batch(self, key):
        k1, k2 = jax.random.split(key)
        return {"x": md.random.normal(k1, [self.batch_dim, self.features]), "y": md.random.normal(k2, [self.batch_dim])}

    def loss(self, params, batch):
        out = [self.batch_dim] if self.loss_dims else ["batch"]
        return md.reduce_mean(md.square(md.einsum(batch["x"], params["w"], out=out) + params["b"] - batch["y"]))


def _regression_loss(p, x, y):
    return jnp.mean(jnp.square(x @ p["w"] + p["b"] - y))


def _mlp_loss(p, x, y):
    return jnp.mean(jnp.square(jax.nn.relu(x @ p["w1"]) @ p["w2"] - y))


def _numpy(tree):
    return {k: v.numpy() for k, v in tree.items()}


CASES = {
    "mlp, batch and d_ff split": (lambda: mlp.Model(mlp.Config.preset("tiny")), _mlp_loss, {"data": 4, "model": 2}, "batch:data; d_ff:model", "spmd"),
    "mlp, gspmd": (lambda: mlp.Model(mlp.Config.preset("tiny")), _mlp_loss, {"data": 4, "model": 2}, "batch:data; d_ff:model", "gspmd"),
    "user model, fsdp": (Regression, _regression_loss, {"data": 2}, md.Layout("batch:data", params="features:data"), "spmd"),
}


@pytest.mark.parametrize("case", CASES)
def test_accumulated_gradients_equal_the_whole_batch(case):
    """One SGD step (lr 1, no clipping) with 4 microbatches moves the parameters by the whole batch's
    gradient, and reports the whole batch's mean loss and gradient norm (plain JAX on global arrays)."""
    make, reference, axes, layout, backend = CASES[case]
    model = make()
    layout = layout if isinstance(layout, md.Layout) else md.Layout(layout)
    trainer = Trainer(model, optim.sgd(1.0), md.Mesh(axes), layout, backend, donate=False, accumulate=4, metrics=True)
    state = trainer.init(jax.random.key_data(jax.random.key(0)))
    batch = model.batch(jax.random.fold_in(jax.random.key(1), 0))
    x, y = (batch[k].numpy() for k in ("x", "y"))
    before = _numpy(state["params"])
    new, metrics = trainer.step(state, jax.random.key_data(jax.random.key(1)))
    want_loss, want_grads = jax.value_and_grad(reference)(before, x, y)
    grads = {k: before[k] - v for k, v in _numpy(new["params"]).items()}
    for k in before:
        np.testing.assert_allclose(grads[k], want_grads[k], rtol=1e-4, atol=1e-6, err_msg=k)
    np.testing.assert_allclose(float(metrics["loss"]), want_loss, rtol=1e-5)
    norm = math.sqrt(sum(float(np.sum(np.square(g))) for g in want_grads.values()))
    np.testing.assert_allclose(float(metrics["grad_norm"]), norm, rtol=1e-5)


def test_accumulation_that_does_not_divide_the_rows_is_named():
    model = mlp.Model(mlp.Config.preset("tiny"))  # batch 16: 2 rows on each of 8 devices
    trainer = Trainer(model, optim.sgd(1.0), md.Mesh({"data": 8}), md.Layout("batch:data"), accumulate=4)
    state = trainer.init(jax.random.key_data(jax.random.key(0)))
    with pytest.raises(md.ConfigError, match=r"--accumulate 4 does not divide the batch of 16 \(2 rows on each device"):
        trainer.step(state, jax.random.key_data(jax.random.key(1)))
    with pytest.raises(md.ConfigError, match="--accumulate 0"):
        Trainer(model, optim.sgd(1.0), md.Mesh({"data": 8}), md.Layout("batch:data"), accumulate=0)
    fixed = Trainer(Regression(loss_dims=True), optim.sgd(1.0), md.Mesh({"data": 2}), md.Layout("batch:data"), accumulate=2)
    state = fixed.init(jax.random.key_data(jax.random.key(0)))
    with pytest.raises(md.ConfigError, match="--accumulate 2: the model's loss fails on a microbatch of 8 rows .*batch=16"):
        fixed.step(state, jax.random.key_data(jax.random.key(1)))


def test_accumulation_memory_is_flat_in_the_microbatches():
    """XLA's temporary memory for one step does not grow with the number of microbatches."""
    model = mlp.Model(mlp.Config(batch=512, d_io=32, d_ff=512))
    temp = {}
    for n in (1, 4, 16):
        trainer = Trainer(model, optim.sgd(1.0), md.Mesh({"data": 1}), md.Layout(), accumulate=n)
        key = jax.random.key_data(jax.random.key(0))
        state = trainer.init(key)
        temp[n] = trainer.step.lower(state, key).compile().memory_analysis().temp_size_in_bytes
    assert temp[16] <= temp[4] <= temp[1], temp
    assert temp[16] < temp[1] / 4, temp
