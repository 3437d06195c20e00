"""md.nn.cross_entropy, all at once and a chunk of positions at a time: values and gradients of the
plain formula (a float64 jax.numpy reference on global arrays) under layouts that split the batch,
the vocabulary and the chunked dim itself, and the chunked loss holds less memory."""

from __future__ import annotations

import dataclasses

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as R
from meshdsl.models import transformer

import meshdsl as md

D = md.Dim
BATCH, LENGTH, D_MODEL, VOCAB = D("batch", 4), D("length", 8), D("d_model", 8), D("vocab", 16)


def _loss(chunk):
    def fn(x, w, targets):
        logits = lambda t: md.einsum(t, w, out=[*t.shape.without(["d_model"]), VOCAB])  # noqa: E731
        return md.nn.cross_entropy(x, targets, logits, "vocab", "length", chunk)

    return fn


def _reference(x, w, targets):
    logits = R.einsum("batch length vocab", x, w)
    return R.reduce("mean", R.logsumexp(logits, "vocab") - R.take_along(logits, targets, "vocab"))


def _args():
    rng = np.random.default_rng(0)
    return (
        harness.from_numpy(rng.standard_normal((4, 8, 8)).astype(np.float32), [BATCH, LENGTH, D_MODEL]),
        harness.from_numpy(rng.standard_normal((8, 16)).astype(np.float32), [D_MODEL, VOCAB]),
        harness.from_numpy(rng.integers(0, 16, (4, 8)).astype(np.int32), [BATCH, LENGTH]),
    )


@pytest.mark.parametrize(
    "chunk, layout",
    [(None, "batch:data; vocab:model"), (2, "batch:data; vocab:model"), (4, "length:model; d_model:data")],
)
def test_cross_entropy_equals_the_plain_formula(chunk, layout):
    assert harness.check(_loss(chunk), _args(), _reference, harness.mesh("data4_model2"), layout)


def test_chunk_must_divide_the_dim():
    x, w, t = _args()
    with pytest.raises(md.ConfigError, match="chunk=3 must be a positive divisor of length=8"):
        md.compile(_loss(3), harness.mesh("x8"), "")(x, w, t)


def _temp_bytes(loss_chunk: int) -> int:
    """Temporary bytes of the compiled gradient of a one-layer Transformer's loss, one device (abstract inputs)."""
    config = transformer.Config(batch=2, length=64, d_model=16, heads=2, d_kv=8, d_ff=32, vocab=512, layers=1)
    model = transformer.Model(dataclasses.replace(config, loss_chunk=loss_chunk))
    mesh = md.Mesh({"x": 1})
    params = jax.eval_shape(md.compile(model.init, mesh, ""), jax.random.key(0))
    batch = jax.eval_shape(md.compile(model.batch, mesh, ""), jax.random.key(1))
    step = md.compile(jax.grad(lambda p, b: model.loss(p, b).array), mesh, "")
    return step.lower(params, batch).compile().memory_analysis().temp_size_in_bytes


def test_chunked_loss_holds_less_memory():
    """The whole [batch, length, vocab] logits (256 KiB here, and their gradient) are not held at once."""
    whole, chunked = _temp_bytes(64), _temp_bytes(8)
    logits = 2 * 64 * 512 * jnp.dtype(jnp.float32).itemsize
    assert chunked < whole - logits, (whole, chunked)


def _ignore_args():
    x, w, t = _args()
    targets = t.numpy().copy()
    targets[0, :5] = -100  # a prompt
    targets[3, 2:] = -100  # padding
    return x, w, harness.from_numpy(targets, [BATCH, LENGTH])


def _plain_ignoring(x, w, targets):
    """transformers' loss on global jax.numpy arrays: the mean over the targets that are not -100."""
    logits = jnp.einsum("bld,dv->blv", x, w)
    kept = targets != -100
    picked = jnp.take_along_axis(logits, jnp.where(kept, targets, 0)[..., None], -1)[..., 0]
    return jnp.sum(jnp.where(kept, jax.nn.logsumexp(logits, -1) - picked, 0.0)) / jnp.sum(kept)


@pytest.mark.parametrize("chunk, layout", [(None, "batch:data; vocab:model"), (2, "length:model; d_model:data")])
@pytest.mark.parametrize("backend", ["spmd", "gspmd"])
def test_ignore_index_leaves_those_targets_out(chunk, layout, backend):
    """Value and gradient of the mean over the kept targets, under layouts splitting the vocab and the chunked dim."""
    x, w, t = _ignore_args()

    def loss(x, w, t):
        logits = lambda a: md.einsum(a, w, out=[*a.shape.without(["d_model"]), VOCAB])  # noqa: E731
        return md.nn.cross_entropy(x, t, logits, "vocab", "length", chunk, ignore_index=-100)

    mesh = harness.mesh("data4_model2")
    got = md.compile(jax.value_and_grad(lambda x, w, t: loss(x, w, t).array, (0, 1)), mesh, layout, backend)(x, w, t)
    want = jax.value_and_grad(_plain_ignoring, (0, 1))(x.numpy(), w.numpy(), t.numpy())
    np.testing.assert_allclose(float(np.asarray(got[0])), float(want[0]), rtol=1e-5)
    for g, h in zip(got[1], want[1]):
        np.testing.assert_allclose(np.asarray(g.numpy()), np.asarray(h), rtol=1e-4, atol=1e-6)
    assert float(want[0]) != pytest.approx(float(_plain_ignoring(x.numpy(), w.numpy(), np.abs(t.numpy()) % 16)))


def test_a_batch_of_ignored_targets_is_an_error_not_nan():
    x, w, _ = _args()
    ignored = harness.from_numpy(np.full((4, 8), -100, np.int32), [BATCH, LENGTH])
    logits = lambda a: md.einsum(a, w, out=[*a.shape.without(["d_model"]), VOCAB])  # noqa: E731
    with pytest.raises(md.DataError, match="every one of the 32 targets .* is ignore_index -100"):
        md.nn.cross_entropy(x, ignored, logits, "vocab", "length", ignore_index=-100)


# ---- a label outside the vocabulary: NaN inside jit, an error where the labels are known ----


@pytest.mark.parametrize("chunk", [None, 2])
@pytest.mark.parametrize("bad", [16, -1, 2**31 - 1, -(2**31)])
def test_label_outside_the_vocabulary_gives_nan_under_jit(bad, chunk):
    # Inside md.compile the labels are traced: the loss is NaN, never the plausible number the
    # loss with the label's logit taken as 0 would be. The same in the chunked path, split or not.
    x, w, t = _args()
    labels = t.numpy().copy()
    labels[1, 5] = bad
    t = harness.from_numpy(labels, [BATCH, LENGTH])
    for layout in ("", "batch:data; vocab:model"):
        loss = md.compile(_loss(chunk), harness.mesh("data4_model2"), layout)(x, w, t)
        assert np.isnan(float(loss.array)), (bad, chunk, layout, float(loss.array))


@pytest.mark.parametrize("chunk", [None, 2])
def test_label_outside_the_vocabulary_is_a_data_error_eagerly(chunk):
    x, w, t = _args()
    labels = t.numpy().copy()
    labels[2, 3] = 16
    with pytest.raises(md.DataError, match=r"label 16 at \(batch=2, length=3\) is outside \[0, 16\)"):
        _loss(chunk)(x, w, harness.from_numpy(labels, [BATCH, LENGTH]))


def test_labels_in_range_are_not_flagged():
    from meshdsl.nn.cross_entropy import invalid_labels

    t = md.tensor(np.array([0, 15, 16, -1], np.int32), [D("n", 4)])
    np.testing.assert_array_equal(invalid_labels(t, 16).numpy(), [False, False, True, True])
