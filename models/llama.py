"""LLaMA-style decoder (Touvron et al., 2023; Llama 3's dims), written once in named dims from ``md.nn``.

Dims: ``batch, length, d_model, kv_heads, group, d_kv, d_ff, vocab, layers`` (and ``memory``,
the keys' copy of ``length``; ``kv``, the fused key/value projections). ``group`` is the query
heads of each key/value head (``heads // kv_heads``): the queries are ``[batch, kv_heads, group,
length, d_kv]``. Built from ``md.nn``: ``Embedding``, pre-norm ``RMSNorm``s, causal grouped-query
``MultiHeadAttention`` with ``Rotary`` embeddings (rotate-half, Hugging Face's convention, or
Meta's interleaved pairs), a SwiGLU ``GatedMLP``, an untied ``Linear`` unembedding and softmax
cross-entropy over ``vocab``. Layers are stacked along ``layers`` and run with ``md.scan``; the
pipeline parts (``pre``, ``layer``, ``post``) are the Transformer's.

Megatron splits ``kv_heads`` (each device its key/value heads and their queries) with ``d_ff``
and ``vocab``; FSDP stores parameters split along ``d_model``. :meth:`Model.hf_names` maps the
parameters to a Hugging Face LLaMA checkpoint's tensors for ``md.checkpoint.load_safetensors``.

The synthetic task is the Transformer's (``t[i+1] = (5 t[i] + 3) mod vocab``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from meshdsl.models import transformer
from meshdsl.models.presets import Presets

import meshdsl as md
from meshdsl.checkpoint.safetensors_io import Source
from meshdsl.errors import ConfigError
from meshdsl.planner.flops import attention_flops

LLAMA3 = dict(kv_heads=8, vocab=128256, rope_theta=500000.0)


@dataclasses.dataclass(frozen=True)
class Config(Presets):
    batch: int = 32
    length: int = 128
    d_model: int = 256
    heads: int = 8
    kv_heads: int = 4
    d_kv: int = 32
    d_ff: int = 768
    vocab: int = 1024
    layers: int = 4
    rope_theta: float = 10000.0
    rope: str = "half"
    norm_eps: float = 1e-5
    remat: bool = False
    remat_policy: str = "full"
    """With ``remat``, what each layer keeps for the backward pass (``md.scan``'s ``REMAT_POLICIES``):
    ``"full"`` nothing, ``"dots"`` its projections' and feed-forward's matmul outputs."""
    compute_dtype: str = "float32"
    loss_chunk: int = 256
    """Positions along ``length`` whose logits the loss computes at once (``md.nn.cross_entropy``): the
    whole ``[batch, length, vocab]`` float32 logits are never held. ``length`` or more, or a size that
    does not divide ``length``: all at once. The values are the same either way."""

    PRESETS = {
        "tiny": dict(batch=32, length=16, d_model=32, heads=16, kv_heads=8, d_kv=4, d_ff=64, vocab=64, layers=2),
        "small": dict(batch=16, length=64, d_model=128, heads=16, kv_heads=8, d_kv=16, d_ff=384, vocab=1024, layers=4),
        # Llama 3.2 1B's dims (its embeddings are tied; here the unembedding is its own).
        "1b": dict(batch=256, length=2048, d_model=2048, heads=32, d_kv=64, d_ff=8192, layers=16, **LLAMA3),
        # Llama 3 8B's published dims.
        "8b": dict(
            batch=64,
            length=4096,
            d_model=4096,
            heads=32,
            d_kv=128,
            d_ff=14336,
            layers=32,
            remat=True,
            compute_dtype="bfloat16",
            **LLAMA3,
        ),
    }

    def __post_init__(self) -> None:
        if self.kv_heads < 1 or self.heads % self.kv_heads:
            raise ConfigError(f"heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")
        if self.d_kv % 2:
            raise ConfigError(f"d_kv={self.d_kv} must be even: rotary embeddings rotate pairs of entries")
        if self.rope not in ("half", "interleaved"):
            raise ConfigError(f"rope must be 'half' (Hugging Face's) or 'interleaved' (Meta's), got {self.rope!r}")
        transformer.check_remat_policy(self.remat_policy)


class Model(transformer.Model):
    """The LLaMA for ``config``: ``init``, ``batch``, ``loss``, ``logits`` and the pipeline parts."""

    LAYOUTS = ("data_parallel", "megatron", "dp_tp", "fsdp")
    """The shipped layouts (layouts/*.toml) this model is benchmarked under by default."""

    def __init__(self, config: Config):
        c = self.config = config
        D = md.Dim
        self.batch_dim, self.length, self.memory = D("batch", c.batch), D("length", c.length), D("memory", c.length)
        self.d_model, self.d_kv, self.d_ff = D("d_model", c.d_model), D("d_kv", c.d_kv), D("d_ff", c.d_ff)
        self.kv_heads, self.group = D("kv_heads", c.kv_heads), D("group", c.heads // c.kv_heads)
        self.vocab, self.layers = D("vocab", c.vocab), D("layers", c.layers)
        self.dtype = jax.numpy.dtype(c.compute_dtype)
        self.norm = md.nn.RMSNorm(self.d_model, eps=c.norm_eps)
        rotary = md.nn.Rotary(self.d_kv, theta=c.rope_theta, interleaved=c.rope == "interleaved")
        self.attention = md.nn.MultiHeadAttention(
            self.d_model, self.group, self.d_kv, kv_heads=self.kv_heads, causal=True, rotary=rotary
        )
        self.feed_forward = md.nn.GatedMLP(self.d_model, self.d_ff)
        self.embedding = md.nn.Embedding(self.vocab, self.d_model)
        self.unembedding = md.nn.Linear(self.d_model, self.vocab)

    def init(self, key: jax.Array) -> dict[str, Any]:
        """Parameters: normal(0, 1/sqrt(fan_in)) weights, unit norm scales, normal(0, 1) embeddings."""
        L = [self.layers]
        k_attn, k_ff, k_embed, k_out = jax.random.split(key, 4)
        attention, feed_forward = self.attention.init(k_attn, L), self.feed_forward.init(k_ff, L)
        layer = {"attn_norm": self.norm.init(None, L), **attention, "mlp_norm": self.norm.init(None, L), **feed_forward}
        return {
            "embed": self.embedding.init(k_embed),
            "layers": layer,
            "final_norm": self.norm.init(None),
            "unembed": self.unembedding.init(k_out),
        }

    def _layer(self, x: md.Tensor, p: dict[str, md.Tensor], cache: md.nn.KVCache | None = None) -> md.Tensor:
        w = self._weights(p)
        attention = {"wq": w["wq"], "wkv": w["wkv"], "wo": w["wo"]}
        x = x + self.attention(attention, self.norm(w["attn_norm"], x), cache=cache)
        return x + self.feed_forward({k: w[k] for k in ("w_gate", "w_in", "w_out")}, self.norm(w["mlp_norm"], x))

    def flops_per_step(self) -> float:
        """Model FLOPs of a training step: 6 x parameters x tokens, plus causal attention over every query
        head (half of full attention's, :func:`meshdsl.planner.flops.attention_flops`)."""
        c = self.config
        per_layer = 2 * c.d_model * c.d_kv * (c.heads + c.kv_heads) + 3 * c.d_model * c.d_ff
        params = c.layers * per_layer + c.d_model * c.vocab
        attention = attention_flops(c.batch, c.heads, c.length, c.length, c.d_kv, causal=True)
        return 6 * params * c.batch * c.length + c.layers * attention

    def hf_names(self) -> dict[str, Source]:
        """Where each parameter is in a Hugging Face LLaMA checkpoint (``LlamaForCausalLM``'s names).

        Hugging Face stores a projection as ``[out_features, in_features]``, the output rows of a
        query or key head in the rotate-half order of its rotary embeddings (its conversion from
        Meta's checkpoints permuted them so): this model's ``rope="half"`` reads them as they
        are. ``rope="interleaved"`` (Meta's pairs) would need those rows permuted back, which
        this mapping does not do: a ConfigError.
        """
        if self.config.rope != "half":
            raise ConfigError(
                f"hf_names: Hugging Face's LLaMA weights are for rope='half' (rotate-half), not {self.config.rope!r}"
            )
        layer = "model.layers.{layers}."
        return {
            "embed": Source("model.embed_tokens.weight", "vocab d_model"),
            "layers/attn_norm": Source(layer + "input_layernorm.weight", "d_model"),
            "layers/wq": Source(layer + "self_attn.q_proj.weight", "(kv_heads group d_kv) d_model"),
            "layers/wkv": Source(
                layer + "self_attn.{kv}_proj.weight", "(kv_heads d_kv) d_model", values={"kv": ("k", "v")}
            ),
            "layers/wo": Source(layer + "self_attn.o_proj.weight", "d_model (kv_heads group d_kv)"),
            "layers/mlp_norm": Source(layer + "post_attention_layernorm.weight", "d_model"),
            "layers/w_gate": Source(layer + "mlp.gate_proj.weight", "d_ff d_model"),
            "layers/w_in": Source(layer + "mlp.up_proj.weight", "d_ff d_model"),
            "layers/w_out": Source(layer + "mlp.down_proj.weight", "d_model d_ff"),
            "final_norm": Source("model.norm.weight", "d_model"),
            "unembed": Source("lm_head.weight", "vocab d_model"),
        }
