"""The shipped llama model: Hugging Face weights from a safetensors file give the logits of a plain-JAX
LLaMA forward pass; it trains under the shipped layouts; the loader's mistakes are named.

The reference is Hugging Face's ``LlamaForCausalLM`` forward written out in jax.numpy on the file's
own arrays (``[out, in]`` projections, rotate-half rotary embeddings, ``repeat_kv`` for the
grouped key/value heads, RMSNorm in float32), sharing no code with meshdsl.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from meshdsl.models import llama
from safetensors.numpy import save_file

import meshdsl as md
from meshdsl.train import optim
from meshdsl.train.step import Trainer

CONFIG = llama.Config(
    batch=4, length=8, d_model=16, heads=4, kv_heads=2, d_kv=4, d_ff=24, vocab=32, layers=2, rope_theta=10000.0
)
LAYOUTS = Path(__file__).resolve().parents[1] / "layouts"


def hf_weights(c: llama.Config, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights under Hugging Face's LLaMA names and shapes."""
    rng = np.random.default_rng(seed)

    def w(*shape: int, scale: float = 0.3) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    out = {
        "model.embed_tokens.weight": w(c.vocab, c.d_model, scale=1.0),
        "model.norm.weight": 1 + w(c.d_model, scale=0.1),
        "lm_head.weight": w(c.vocab, c.d_model),
    }
    for i in range(c.layers):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": 1 + w(c.d_model, scale=0.1),
            p + "post_attention_layernorm.weight": 1 + w(c.d_model, scale=0.1),
            p + "self_attn.q_proj.weight": w(c.heads * c.d_kv, c.d_model),
            p + "self_attn.k_proj.weight": w(c.kv_heads * c.d_kv, c.d_model),
            p + "self_attn.v_proj.weight": w(c.kv_heads * c.d_kv, c.d_model),
            p + "self_attn.o_proj.weight": w(c.d_model, c.heads * c.d_kv),
            p + "mlp.gate_proj.weight": w(c.d_ff, c.d_model),
            p + "mlp.up_proj.weight": w(c.d_ff, c.d_model),
            p + "mlp.down_proj.weight": w(c.d_model, c.d_ff),
        }
    return out


def hf_logits(w: dict[str, np.ndarray], ids: np.ndarray, c: llama.Config) -> np.ndarray:
    """Hugging Face's LLaMA forward pass in jax.numpy: logits ``[batch, length, vocab]``."""
    w = {k: jnp.asarray(v) for k, v in w.items()}
    B, T = ids.shape
    H, K, Dh = c.heads, c.kv_heads, c.d_kv

    def rms(x, g):
        return g * (x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + c.norm_eps))

    def rotate_half(x):
        return jnp.concatenate([-x[..., Dh // 2 :], x[..., : Dh // 2]], -1)

    inv_freq = 1.0 / (c.rope_theta ** (jnp.arange(0, Dh, 2, dtype=jnp.float32) / Dh))
    emb = jnp.concatenate([jnp.outer(jnp.arange(T), inv_freq)] * 2, -1)
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    heads = lambda x, n: x.reshape(B, T, n, Dh).transpose(0, 2, 1, 3)  # noqa: E731
    x = w["model.embed_tokens.weight"][ids]
    for i in range(c.layers):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q, k, v = (heads(h @ w[p + f"self_attn.{n}_proj.weight"].T, m) for n, m in (("q", H), ("k", K), ("v", K)))
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        # repeat_kv: query head n reads kv head n // (H/K)
        k, v = jnp.repeat(k, H // K, axis=1), jnp.repeat(v, H // K, axis=1)
        scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(Dh)
        scores = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, -jnp.inf)
        attended = (jax.nn.softmax(scores, -1) @ v).transpose(0, 2, 1, 3).reshape(B, T, H * Dh)
        x = x + attended @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gated = jax.nn.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)
        x = x + gated @ w[p + "mlp.down_proj.weight"].T
    return np.asarray(rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    weights = hf_weights(CONFIG)
    path = tmp_path_factory.mktemp("hf") / "model.safetensors"
    save_file(weights, str(path))
    return path, weights


class SpyReads:
    """``safetensors.safe_open`` that records every ``get_slice(name)[index]`` read."""

    reads: list[tuple[str, tuple]] = []

    def __init__(self, real, *args, **kwargs):
        self.file = real(*args, **kwargs)

    def __enter__(self):
        self.file.__enter__()
        return self

    def __exit__(self, *exc):
        return self.file.__exit__(*exc)

    def keys(self):
        return self.file.keys()

    def get_slice(self, name):
        part = self.file.get_slice(name)
        spy = self

        class Slice:
            def get_shape(self):
                return part.get_shape()

            def get_dtype(self):
                return part.get_dtype()

            def __getitem__(self, index):
                spy.reads.append((name, index))
                return part[index]

        return Slice()


LOAD_LAYOUTS = {
    "megatron": ({"data": 2, "model": 2}, "batch:data; kv_heads:model; d_ff:model; vocab:model"),
    "d_model_and_layers": ({"data": 2, "model": 2, "stage": 2}, "batch:data; d_model:model; layers:stage"),
}


@pytest.mark.parametrize("name", list(LOAD_LAYOUTS))
def test_hf_safetensors_logits_equal_plain_jax(name, checkpoint, monkeypatch):
    """Loaded from Hugging Face's layout, laid out as asked, each device reading only its rows; the
    model's logits equal Hugging Face's forward pass of the same weights."""
    import safetensors

    path, weights = checkpoint
    axes, rules = LOAD_LAYOUTS[name]
    mesh, layout = md.Mesh(axes), md.Layout(rules)
    model = llama.Model(CONFIG)
    like = jax.eval_shape(model.init, jax.random.key(0))
    real = safetensors.safe_open
    SpyReads.reads = []
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: SpyReads(real, *a, **k))
    params = md.checkpoint.load_safetensors(path, like=like, names=model.hf_names(), mesh=mesh, layout=layout)
    for leaf in jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, md.Tensor)):
        harness.assert_laid_out(leaf, layout, mesh, "loaded parameter")
    ids = np.random.default_rng(1).integers(0, CONFIG.vocab, (CONFIG.batch, CONFIG.length)).astype(np.int32)
    logits = md.compile(model.logits, mesh, layout)(params, md.tensor(ids, "batch length"))
    assert logits.names == ("batch", "length", "vocab")
    harness.assert_values_close(logits.numpy(), hf_logits(weights, ids, CONFIG), 1e-4, "logits")
    if name == "megatron":  # up_proj's rows split over model=2: each device read half of them
        ups = [i for n, i in SpyReads.reads if n == "model.layers.0.mlp.up_proj.weight"]
        assert {(s[0].start, s[0].stop) for s in ups} == {(0, 12), (12, 24)}, ups
    else:  # layers over stage: each device read only its own layer
        # 4 devices of stage 0, 9 tensors
        assert sum(n.startswith("model.layers.0.") for n, _ in SpyReads.reads) == 4 * 9
        # down_proj is [d_model, d_ff]: its rows split over model
        downs = [i for n, i in SpyReads.reads if n == "model.layers.1.mlp.down_proj.weight"]
        assert {(s[0].start, s[0].stop) for s in downs} == {(0, 8), (8, 16)}, downs


def test_loading_converts_bf16(tmp_path):
    """A bfloat16 checkpoint loads into float32 parameters with the bf16 values."""
    import ml_dtypes

    weights = {k: v.astype(ml_dtypes.bfloat16) for k, v in hf_weights(CONFIG).items()}
    save_file(weights, str(tmp_path / "bf16.safetensors"))
    model = llama.Model(CONFIG)
    like = jax.eval_shape(model.init, jax.random.key(0))
    params = md.checkpoint.load_safetensors(
        tmp_path / "bf16.safetensors", like=like, names=model.hf_names(), mesh=md.Mesh({"x": 1})
    )
    assert params["embed"].dtype == jnp.float32
    np.testing.assert_array_equal(params["embed"].numpy(), weights["model.embed_tokens.weight"].astype(np.float32))
    up = weights["model.layers.1.mlp.up_proj.weight"].astype(np.float32)
    np.testing.assert_array_equal(params["layers"]["w_in"].numpy()[1], up.T)


def test_loader_mistakes_are_named(tmp_path, checkpoint):
    path, weights = checkpoint
    model = llama.Model(CONFIG)
    like = jax.eval_shape(model.init, jax.random.key(0))
    mesh = md.Mesh({"x": 1})

    def load(p, names=None):
        return md.checkpoint.load_safetensors(p, like=like, names=names or model.hf_names(), mesh=mesh)

    with pytest.raises(md.DataError, match="no safetensors file at .*missing.safetensors"):
        load(tmp_path / "missing.safetensors")
    short = {k: v for k, v in weights.items() if k != "model.layers.1.mlp.up_proj.weight"}
    save_file(short, str(tmp_path / "short.safetensors"))
    with pytest.raises(md.DataError, match=r"has no tensor 'model.layers.1.mlp.up_proj.weight' \(for layers/w_in\)"):
        load(tmp_path / "short.safetensors")
    save_file({**weights, "lm_head.weight": weights["lm_head.weight"].T.copy()}, str(tmp_path / "wrong.safetensors"))
    with pytest.raises(md.DataError, match=r"'lm_head.weight' .* has shape \[16, 32\]; unembed .* needs \[32, 16\]"):
        load(tmp_path / "wrong.safetensors")
    names = dict(model.hf_names())
    del names["final_norm"]
    with pytest.raises(md.ConfigError, match=r"no source in names for the parameters \['final_norm'\]"):
        load(path, names)
    with pytest.raises(md.ConfigError, match="names .*d_ff"):
        load(path, {**model.hf_names(), "final_norm": md.checkpoint.Source("model.norm.weight", "d_ff")})


def test_config_mistakes_are_named():
    with pytest.raises(md.ConfigError, match="heads=6 must be a multiple of kv_heads=4"):
        dataclasses.replace(CONFIG, heads=6, kv_heads=4)
    with pytest.raises(md.ConfigError, match="d_kv=5 must be even"):
        dataclasses.replace(CONFIG, d_kv=5)


def test_llama_trains_under_the_shipped_layouts_like_one_device():
    """Losses under data parallel, Megatron (kv_heads split) and FSDP equal one device's, and fall."""
    model = llama.Model(llama.Config.preset("tiny"))
    reference, _ = harness.train(Trainer(model, optim.adamw(1e-2), md.Mesh({"x": 1}), md.Layout()), 20)
    assert reference[-5:].mean() < 0.7 * reference[0], reference
    for name in model.LAYOUTS:
        layout = md.Layout.load(LAYOUTS / f"{name}.toml")
        losses, _ = harness.train(Trainer(model, optim.adamw(1e-2), layout.mesh(), layout), 5)
        np.testing.assert_allclose(losses, reference[:5], rtol=1e-4, err_msg=name)


def test_explain_knows_llama(capsys):
    """``meshdsl explain`` on the shipped llama: the shipped Megatron layout splits its key/value heads.
    (``meshdsl search --model llama --preset 8b --devices 64 ...`` traces dozens of candidates: run by hand.)"""
    from meshdsl.cli import main

    assert main(["explain", "--model", "llama", "--preset", "tiny", "--layout", "megatron", "--no-compile"]) == 0
    out = capsys.readouterr().out
    assert "kv_heads:model" in out, out
