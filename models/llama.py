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

The Hugging Face families are this one decoder with switches (:mod:`meshdsl.hf` reads them from a
``config.json``): ``tie_embeddings`` (one table for input and output), ``rope_scaling="llama3"``
(Llama 3.1/3.2's scaled frequencies), ``qkv_bias`` (Qwen2), ``qk_norm`` (Qwen3: an RMSNorm over each
head's queries and keys before rope), and Gemma's ``activation="gelu_tanh"``, ``embed_scale``
(embeddings times sqrt(d_model)) and ``norm_offset=1.0`` (RMSNorm as ``(1 + w)``).

The synthetic task is the Transformer's (``t[i+1] = (5 t[i] + 3) mod vocab``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
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
    tie_embeddings: bool = False
    """One ``[vocab, d_model]`` table for the input embedding and the output logits (no ``unembed``
    parameter; its gradient is the sum of both uses): Hugging Face's ``tie_word_embeddings``."""
    rope_scaling: str = "none"
    """``"none"``, or ``"llama3"``: Llama 3.1/3.2's frequencies (the ``rope_factor``, ``rope_low_freq_factor``,
    ``rope_high_freq_factor`` and ``rope_original_length`` fields; transformers' ``_compute_llama3_parameters``)."""
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_length: int = 8192
    qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2), not on the output projection."""
    qk_norm: bool = False
    """An RMSNorm over ``d_kv`` of each head's queries and keys before rope (Qwen3)."""
    activation: str = "silu"
    """The gated feed-forward's activation: ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (Gemma's GeGLU)."""
    embed_scale: bool = False
    """Embeddings times ``sqrt(d_model)`` rounded to the compute dtype (Gemma)."""
    norm_offset: float = 0.0
    """Every RMSNorm's scale applied as ``norm_offset + w`` (Gemma: 1.0)."""
    compute_dtype: str = "float32"
    loss_chunk: int = 256
    """Positions along ``length`` whose logits the loss computes at once (``md.nn.cross_entropy``): the
    whole ``[batch, length, vocab]`` float32 logits are never held. ``length`` or more, or a size that
    does not divide ``length``: all at once. The values are the same either way."""
    ignore_labels: bool = False
    """Targets equal to ``IGNORE_INDEX`` (transformers' -100) are left out of the loss's mean (fine-tuning on
    padded examples; a Hugging Face folder's model sets it). Off, the loss counts no positions, so a step
    moves no extra all-reduce for the count."""

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
        if self.rope_scaling not in ("none", "llama3"):
            raise ConfigError(f"rope_scaling must be 'none' or 'llama3', got {self.rope_scaling!r}")
        if self.rope_scaling == "llama3" and not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise ConfigError(
                f"rope_low_freq_factor={self.rope_low_freq_factor} must be positive and below "
                f"rope_high_freq_factor={self.rope_high_freq_factor}"
            )
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"activation must be one of {', '.join(map(repr, ACTIVATIONS))}, got {self.activation!r}")
        transformer.check_remat_policy(self.remat_policy)

    def inverse_frequencies(self) -> tuple[float, ...] | None:
        """Rope's ``d_kv / 2`` inverse frequencies under ``rope_scaling`` (None: theta's own), as transformers'
        ``_compute_llama3_parameters``: long wavelengths divided by ``rope_factor``, short ones kept, those
        between blended."""
        if self.rope_scaling == "none":
            return None
        inverse = 1.0 / self.rope_theta ** (np.arange(0, self.d_kv, 2, dtype=np.float64) / self.d_kv)
        low, high = self.rope_low_freq_factor, self.rope_high_freq_factor
        wavelength = 2 * math.pi / inverse
        scaled = np.where(wavelength > self.rope_original_length / low, inverse / self.rope_factor, inverse)
        smooth = (self.rope_original_length / wavelength - low) / (high - low)
        blended = (1 - smooth) * scaled / self.rope_factor + smooth * scaled
        medium = (wavelength >= self.rope_original_length / high) & (wavelength <= self.rope_original_length / low)
        return tuple(float(f) for f in np.where(medium, blended, scaled).astype(np.float32))


ACTIVATIONS = {"silu": md.silu, "gelu_tanh": lambda x: md.gelu(x, approximate=True)}
"""The gated feed-forward's activations, by ``Config.activation``."""


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
        self.norm = md.nn.RMSNorm(self.d_model, eps=c.norm_eps, offset=c.norm_offset)
        rotary = md.nn.Rotary(
            self.d_kv, theta=c.rope_theta, interleaved=c.rope == "interleaved", inverse=c.inverse_frequencies()
        )
        qk_norm = md.nn.RMSNorm(self.d_kv, eps=c.norm_eps, offset=c.norm_offset) if c.qk_norm else None
        self.attention = md.nn.MultiHeadAttention(
            self.d_model,
            self.group,
            self.d_kv,
            kv_heads=self.kv_heads,
            causal=True,
            rotary=rotary,
            bias=c.qkv_bias,
            output_bias=False,
            qk_norm=qk_norm,
        )
        self.attention_params = ("wq", "wkv", "wo", *(("q_norm", "k_norm") if c.qk_norm else ()))
        self.feed_forward = md.nn.GatedMLP(self.d_model, self.d_ff, activation=ACTIVATIONS[c.activation])
        self.embedding = md.nn.Embedding(self.vocab, self.d_model)
        self.unembedding = md.nn.Linear(self.d_model, self.vocab)

    def init(self, key: jax.Array) -> dict[str, Any]:
        """Parameters: normal(0, 1/sqrt(fan_in)) weights, unit norm scales, normal(0, 1) embeddings."""
        L = [self.layers]
        k_attn, k_ff, k_embed, k_out = jax.random.split(key, 4)
        attention, feed_forward = self.attention.init(k_attn, L), self.feed_forward.init(k_ff, L)
        layer = {"attn_norm": self.norm.init(None, L), **attention, "mlp_norm": self.norm.init(None, L), **feed_forward}
        params = {"embed": self.embedding.init(k_embed), "layers": layer, "final_norm": self.norm.init(None)}
        return params if self.config.tie_embeddings else {**params, "unembed": self.unembedding.init(k_out)}

    def embed(self, params: dict[str, Any], tokens: md.Tensor) -> md.Tensor:
        """Token embeddings in the compute dtype (times ``sqrt(d_model)`` in that dtype with ``embed_scale``)."""
        x = super().embed(params, tokens)
        if not self.config.embed_scale:
            return x
        return x * float(np.asarray(math.sqrt(self.config.d_model), self.dtype))

    def head(self, params: dict[str, Any], x: md.Tensor) -> md.Tensor:
        """Logits (float32) of the final residual stream: through the embedding table when tied."""
        if not self.config.tie_embeddings:
            return super().head(params, x)
        x = self.norm(md.cast(params["final_norm"], self.dtype), x)
        return md.cast(self.embedding.unembed(md.cast(params["embed"], self.dtype), x), jax.numpy.float32)

    def _layer(self, x: md.Tensor, p: dict[str, md.Tensor], cache: md.nn.KVCache | None = None) -> md.Tensor:
        w = self._weights(p)
        x = x + self.attention({k: w[k] for k in self.attention_params}, self.norm(w["attn_norm"], x), cache=cache)
        return x + self.feed_forward({k: w[k] for k in ("w_gate", "w_in", "w_out")}, self.norm(w["mlp_norm"], x))

    def flops_per_step(self) -> float:
        """Model FLOPs of a training step: 6 x parameters x tokens, plus causal attention over every query
        head (half of full attention's, :func:`meshdsl.planner.flops.attention_flops`). The unembedding's
        matmul counts once whether or not its table is the embedding's (a lookup is no matmul)."""
        c = self.config
        per_layer = 2 * c.d_model * c.d_kv * (c.heads + c.kv_heads) + 3 * c.d_model * c.d_ff
        params = c.layers * per_layer + c.d_model * c.vocab
        attention = attention_flops(c.batch, c.heads, c.length, c.length, c.d_kv, causal=True)
        return 6 * params * c.batch * c.length + c.layers * attention

    def hf_names(self) -> dict[str, Source]:
        """Where each parameter is in a Hugging Face LLaMA checkpoint (``LlamaForCausalLM``'s names; Mistral's,
        Qwen2's, Qwen3's and Gemma's are the same names, with their biases and norms where switched on;
        a tied model has no ``lm_head.weight``).

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
        c, layer = self.config, "model.layers.{layers}."
        kv = {"kv": ("k", "v")}
        q_key, kv_key = ("layers/wq/kernel", "layers/wkv/kernel") if c.qkv_bias else ("layers/wq", "layers/wkv")
        attention = {
            q_key: Source(layer + "self_attn.q_proj.weight", "(kv_heads group d_kv) d_model"),
            kv_key: Source(layer + "self_attn.{kv}_proj.weight", "(kv_heads d_kv) d_model", values=kv),
        }
        if c.qkv_bias:
            attention["layers/wq/bias"] = Source(layer + "self_attn.q_proj.bias", "(kv_heads group d_kv)")
            attention["layers/wkv/bias"] = Source(layer + "self_attn.{kv}_proj.bias", "(kv_heads d_kv)", values=kv)
        if c.qk_norm:
            attention["layers/q_norm"] = Source(layer + "self_attn.q_norm.weight", "d_kv")
            attention["layers/k_norm"] = Source(layer + "self_attn.k_norm.weight", "d_kv")
        names = {
            "embed": Source("model.embed_tokens.weight", "vocab d_model"),
            "layers/attn_norm": Source(layer + "input_layernorm.weight", "d_model"),
            **attention,
            "layers/wo": Source(layer + "self_attn.o_proj.weight", "d_model (kv_heads group d_kv)"),
            "layers/mlp_norm": Source(layer + "post_attention_layernorm.weight", "d_model"),
            "layers/w_gate": Source(layer + "mlp.gate_proj.weight", "d_ff d_model"),
            "layers/w_in": Source(layer + "mlp.up_proj.weight", "d_ff d_model"),
            "layers/w_out": Source(layer + "mlp.down_proj.weight", "d_model d_ff"),
            "final_norm": Source("model.norm.weight", "d_model"),
        }
        return names if c.tie_embeddings else {**names, "unembed": Source("lm_head.weight", "vocab d_model")}
