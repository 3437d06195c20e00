"""Which attention kernel runs: the choice table, its use by md.nn and the plain-JAX baseline, the XLA path's numbers.

On a CPU only XLA's formula runs, so the GPU branch is checked by what is asked of
``jax.nn.dot_product_attention`` with the backend reported as a GPU (the call itself then runs
XLA's formula); on a GPU, :func:`test_cudnn_matches_xla_on_a_gpu` compares the two kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshdsl as md
from meshdsl.errors import ConfigError
from meshdsl.nn import attention_impl
from meshdsl.nn.attention_impl import choose_implementation

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


@pytest.mark.parametrize(
    "platform, dtype, head_dim, mask, limit, want",
    [
        ("gpu", BF16, 128, "causal", 128, "cudnn"),
        ("cuda", F16, 64, "none", 128, "cudnn"),
        ("gpu", BF16, 256, "causal", 256, "cudnn"),  # Hopper and later
        ("gpu", BF16, 256, "causal", 128, "xla"),  # before Hopper: at most 128
        ("gpu", BF16, 136, "causal", 128, "xla"),
        ("gpu", BF16, 100, "causal", 128, "xla"),  # not a multiple of 8
        ("gpu", F32, 128, "causal", 128, "xla"),  # cuDNN's fused kernel wants 16-bit inputs
        ("gpu", BF16, 128, "tensor", 128, "xla"),  # a mask tensor (padding, split causal rows)
        ("cpu", BF16, 128, "causal", 128, "xla"),
        ("tpu", BF16, 128, "none", 128, "xla"),
    ],
)
def test_choice_table(platform, dtype, head_dim, mask, limit, want):
    assert choose_implementation(platform, dtype, head_dim, mask, head_dim_limit=limit) == want


def test_explicit_implementation_wins_and_mistakes_are_named():
    assert choose_implementation("cpu", F32, 7, "tensor", explicit="cudnn") == "cudnn"
    assert choose_implementation("gpu", BF16, 128, "causal", explicit="xla") == "xla"
    with pytest.raises(ConfigError, match="'flash' is not one of xla, cudnn"):
        choose_implementation("gpu", BF16, 128, "causal", explicit="flash")
    with pytest.raises(ConfigError, match="mask kind 'padding'"):
        choose_implementation("gpu", BF16, 128, "padding")


class _Device:
    def __init__(self, capability):
        self.compute_capability = capability


def test_max_head_dim_follows_compute_capability():
    assert attention_impl.max_head_dim(_Device("9.0")) == 256
    assert attention_impl.max_head_dim(_Device("8.0")) == 128
    assert attention_impl.max_head_dim(_Device(None)) == 128


def _ask_as_a_gpu(monkeypatch) -> list[str | None]:
    """Report the backend as a GPU (of compute capability 9.0) and record the ``implementation``
    each ``jax.nn.dot_product_attention`` call asks for, running XLA's formula instead."""
    asked: list[str | None] = []
    kernel = jax.nn.dot_product_attention

    def spy(*args, implementation=None, **kwargs):
        asked.append(implementation)
        return kernel(*args, implementation="xla", **kwargs)

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(attention_impl, "max_head_dim", lambda device=None: 256)
    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    return asked


def _qkv(dtype, b=2, n=2, t=16, h=8, seed=0):
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal((b, n, t, h)).astype(np.float32) for _ in range(3)]
    names = ["batch heads length d_kv", "batch heads memory d_kv", "batch heads memory d_kv"]
    return arrays, [md.tensor(jnp.asarray(a, dtype), n) for a, n in zip(arrays, names)]


def _reference(q, k, v, causal):
    """float64 softmax(q k / sqrt(h)) v."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    scores = np.einsum("bnth,bnsh->bnts", q, k) / np.sqrt(q.shape[-1])
    if causal:
        scores = np.where(np.tril(np.ones(scores.shape[-2:], bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bnts,bnsh->bnth", p / p.sum(-1, keepdims=True), v)


def test_md_attention_asks_for_cudnn_on_a_gpu_only_where_it_fits(monkeypatch):
    """bf16, causal from 0: cuDNN; f32, a padding mask, causal rows of a split length: XLA; explicit wins."""
    asked = _ask_as_a_gpu(monkeypatch)
    _, (q, k, v) = _qkv(BF16)
    _, (q32, k32, v32) = _qkv(F32)
    pad = md.tensor(np.arange(16)[None, :] < np.array([16, 9])[:, None], "batch memory")
    mesh = md.Mesh({"data": 2, "model": 2})
    attend = md.nn.dot_product_attention

    def causal(q: md.Tensor, k: md.Tensor, v: md.Tensor) -> md.Tensor:
        return attend(q, k, v, causal=True)

    cases = [
        (lambda: jax.eval_shape(lambda: attend(q, k, v, causal=True)), "cudnn"),
        (lambda: jax.eval_shape(lambda: attend(q32, k32, v32, causal=True)), "xla"),
        (lambda: jax.eval_shape(lambda: attend(q, k, v, causal=True, mask=pad)), "xla"),
        (lambda: jax.eval_shape(lambda: attend(q, k, v, causal=True, implementation="xla")), "xla"),
        (lambda: md.explain(causal, mesh, "batch:data; heads:model", q, k, v), "cudnn"),
        (lambda: md.explain(causal, mesh, "batch:data; length:model", q, k, v), "xla"),
    ]
    for i, (run, want) in enumerate(cases):
        asked.clear()
        run()
        # md.explain traces the shapes on global arrays first, then the shards: the last call is the shard's
        assert asked and asked[-1] == want, f"case {i}: asked {asked}, want {want}"


def test_transformer_and_its_plain_jax_baseline_ask_for_the_same_kernel(monkeypatch):
    """The shipped Transformer (bf16, head size 8) and bench's hand-written one: cuDNN on a GPU, alike."""
    from meshdsl.bench import baselines
    from meshdsl.model.loader import build_model
    from meshdsl.train import optim
    from meshdsl.train.step import Trainer

    asked = _ask_as_a_gpu(monkeypatch)
    model = build_model("transformer", "tiny", compute_dtype="bfloat16", d_kv=8)
    trainer = Trainer(model, optim.make("adamw"), md.Mesh({"data": 1}), md.Layout("batch:data"))
    state = trainer.abstract_state()
    batch = jax.eval_shape(model.batch, jax.ShapeDtypeStruct((2,), jnp.uint32))
    jax.eval_shape(lambda p, b: model.loss(p, b).array, state["params"], batch)
    ours = set(asked)
    asked.clear()
    arrays = jax.tree_util.tree_map(lambda t: t.array, state["params"], is_leaf=lambda x: isinstance(x, md.Tensor))
    plain = jax.eval_shape(lambda k: baselines._transformer_batch(k, model.config), jax.random.key(0))
    jax.eval_shape(lambda p, b: baselines._transformer_loss(p, b, model.config, lambda x, names: x), arrays, plain)
    assert ours == set(asked) == {"cudnn"}


@pytest.mark.parametrize("dtype, tol", [(F32, 1e-5), (BF16, 3e-2)])
def test_xla_path_numbers(dtype, tol):
    """On a CPU the chosen kernel is XLA's formula; its numbers equal a float64 reference."""
    arrays, (q, k, v) = _qkv(dtype, seed=3)
    for causal in (False, True):
        got = jax.jit(lambda q, k, v, causal=causal: md.nn.dot_product_attention(q, k, v, causal=causal))(q, k, v)
        want = _reference(*(np.asarray(jnp.asarray(a, dtype), np.float64) for a in arrays), causal)
        np.testing.assert_allclose(np.asarray(got.array, np.float64), want, atol=tol, rtol=tol)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (run with JAX_PLATFORMS=cuda)")
def test_cudnn_matches_xla_on_a_gpu():
    """On a GPU, bf16: cuDNN's fused attention (the default) equals XLA's formula within bf16 tolerance."""
    _, (q, k, v) = _qkv(BF16, b=2, n=4, t=256, h=128, seed=4)
    fused = jax.jit(lambda q, k, v: md.nn.dot_product_attention(q, k, v, causal=True))(q, k, v)
    xla = functools.partial(md.nn.dot_product_attention, causal=True, implementation="xla")
    formula = jax.jit(xla)(q, k, v)
    got, want = (np.asarray(x.array, np.float32) for x in (fused, formula))
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)
