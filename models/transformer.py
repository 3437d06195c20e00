"""Decoder-only Transformer language model, written once in named dims.

Dims: ``batch, length, d_model, heads, d_kv, d_ff, vocab, layers`` (and ``memory``, the keys'
copy of ``length``, and ``qkv``, the three fused attention projections). Built from ``md.nn``:
``Embedding``, causal ``MultiHeadAttention``, the ``MLP`` feed-forward, ``RMSNorm`` or
``LayerNorm`` (no bias), a ``Linear`` unembedding, and softmax cross-entropy over ``vocab``
(which a layout may split: the logsumexp then costs one pmax and one psum). The layers'
parameters are stacked along ``layers`` and run with ``md.scan``.

The synthetic task: each sequence follows ``t[i+1] = (5 t[i] + 3) mod vocab`` from a random
start (so ``t[i] = 5^i t[0] + 3 (1 + 5 + ... + 5^(i-1)) mod vocab``), the next token is
learnable and the loss falls clearly.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from meshdsl.models.presets import Presets

import meshdsl as md
from meshdsl.errors import ConfigError
from meshdsl.ops.scan import REMAT_POLICIES
from meshdsl.planner.flops import attention_flops

IGNORE_INDEX = -100
"""A target the loss leaves out (transformers' convention: padding, prompt tokens)."""


@dataclasses.dataclass(frozen=True)
class Config(Presets):
    batch: int = 32
    length: int = 128
    d_model: int = 256
    heads: int = 8
    d_kv: int = 32
    d_ff: int = 1024
    vocab: int = 1024
    layers: int = 4
    norm: str = "rms"
    remat: bool = False
    remat_policy: str = "full"
    """With ``remat``, what each layer keeps for the backward pass (``md.scan``'s ``REMAT_POLICIES``):
    ``"full"`` nothing, ``"dots"`` its projections' and feed-forward's matmul outputs."""
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
        "tiny": dict(batch=8, length=16, d_model=32, heads=8, d_kv=4, d_ff=64, vocab=64, layers=2),
        "small": dict(batch=16, length=64, d_model=128, heads=8, d_kv=16, d_ff=512, vocab=1024, layers=4),
        "1b": dict(batch=256, length=2048, d_model=2048, heads=16, d_kv=128, d_ff=8192, vocab=32768, layers=18),
    }

    def __post_init__(self) -> None:
        if self.norm not in ("rms", "layer"):
            raise ConfigError(f"norm must be 'rms' or 'layer', got {self.norm!r}")
        check_remat_policy(self.remat_policy)


class Model:
    LAYOUTS = ("data_parallel", "megatron", "dp_tp", "fsdp")
    """The shipped layouts (layouts/*.toml) this model is benchmarked under by default."""
    """The Transformer for ``config``: ``init``, ``batch``, ``loss``."""

    def __init__(self, config: Config):
        c = self.config = config
        D = md.Dim
        self.batch_dim, self.length, self.memory = D("batch", c.batch), D("length", c.length), D("memory", c.length)
        self.d_model, self.heads, self.d_kv = D("d_model", c.d_model), D("heads", c.heads), D("d_kv", c.d_kv)
        self.d_ff, self.vocab, self.layers = D("d_ff", c.d_ff), D("vocab", c.vocab), D("layers", c.layers)
        self.qkv = D("qkv", 3)
        self.dtype = jnp.dtype(c.compute_dtype)
        self.norm = md.nn.RMSNorm(self.d_model) if c.norm == "rms" else md.nn.LayerNorm(self.d_model, bias=False)
        self.attention = md.nn.MultiHeadAttention(self.d_model, self.heads, self.d_kv, causal=True)
        self.feed_forward = md.nn.MLP(self.d_model, self.d_ff)
        self.embedding = md.nn.Embedding(self.vocab, self.d_model)
        self.unembedding = md.nn.Linear(self.d_model, self.vocab)

    def init(self, key: jax.Array) -> dict[str, Any]:
        """Parameters: normal(0, 1/sqrt(fan_in)) weights, unit norm scales; the same under every layout.

        Each weight takes its key from one split in a fixed order (the parameters of the model
        before it was built on ``md.nn``, bit for bit).
        """
        L = [self.layers]
        keys = iter(jax.random.split(key, 8))
        layer = {
            "norm1": self.norm.init(None, L),
            "wqkv": self.attention.qkv_projection.init(next(keys), L),
            "wo": self.attention.output_projection.init(next(keys), L),
            "norm2": self.norm.init(None, L),
            "w_in": self.feed_forward.input_projection.init(next(keys), L),
            "w_out": self.feed_forward.output_projection.init(next(keys), L),
        }
        return {
            "embed": self.embedding.init(next(keys)),
            "layers": layer,
            "final_norm": self.norm.init(None),
            "unembed": self.unembedding.init(next(keys)),
        }

    def _weights(self, p: dict[str, md.Tensor]) -> dict[str, md.Tensor]:
        """One layer's parameters (a projection's ``{"kernel", "bias"}`` too) in the compute dtype (f32 masters
        stay in the state)."""
        return jax.tree_util.tree_map(lambda v: md.cast(v, self.dtype), p, is_leaf=lambda v: isinstance(v, md.Tensor))

    def _attention(self, x: md.Tensor, w: dict[str, md.Tensor], cache: md.nn.KVCache | None = None) -> md.Tensor:
        """``x`` plus causal multi-head self-attention of its norm (``cache``: decoding, see ``decode``)."""
        return x + self.attention({"wqkv": w["wqkv"], "wo": w["wo"]}, self.norm(w["norm1"], x), cache=cache)

    def _feed_forward(self, x: md.Tensor, w: dict[str, md.Tensor]) -> md.Tensor:
        """``x`` plus the GELU feed-forward of its norm."""
        return x + self.feed_forward({"w_in": w["w_in"], "w_out": w["w_out"]}, self.norm(w["norm2"], x))

    def _layer(self, x: md.Tensor, p: dict[str, md.Tensor], cache: md.nn.KVCache | None = None) -> md.Tensor:
        w = self._weights(p)
        return self._feed_forward(self._attention(x, w, cache), w)

    @property
    def remat(self) -> bool | str:
        """``md.scan``'s ``remat`` of the layers: False, or the config's ``remat_policy``."""
        return self.config.remat_policy if self.config.remat else False

    def embed(self, params: dict[str, Any], tokens: md.Tensor) -> md.Tensor:
        """Token embeddings ``[batch, length, d_model]`` in the compute dtype."""
        return md.cast(self.embedding(params["embed"], tokens), self.dtype)

    def head(self, params: dict[str, Any], x: md.Tensor) -> md.Tensor:
        """Logits ``[batch, length, vocab]`` (float32) of the final residual stream ``x``."""
        x = self.norm(md.cast(params["final_norm"], self.dtype), x)
        return md.cast(self.unembedding(md.cast(params["unembed"], self.dtype), x), jnp.float32)

    def cross_entropy(self, logits: md.Tensor, targets: md.Tensor) -> md.Tensor:
        """Mean next-token cross-entropy over the targets that are not ``IGNORE_INDEX``; over a split ``vocab``
        it costs one pmax and two small psums."""
        return md.nn.cross_entropy(logits, targets, lambda t: t, self.vocab, self.length, ignore_index=self._ignored)

    def logits(self, params: dict[str, Any], tokens: md.Tensor) -> md.Tensor:
        x, _ = md.scan(
            lambda x, p: (self._layer(x, p), None),
            self.embed(params, tokens),
            params["layers"],
            "layers",
            remat=self.remat,
        )
        return self.head(params, x)

    @property
    def _ignored(self) -> int | None:
        """The target the loss leaves out (``IGNORE_INDEX`` with ``config.ignore_labels``), else None."""
        return IGNORE_INDEX if self.config.ignore_labels else None

    @property
    def decodes(self) -> bool:
        """Whether ``decode`` runs this model's forward pass: its ``logits`` are the Transformer's scan of
        ``_layer`` (llama's are); a subclass with other layers (the MoE) does not decode."""
        return type(self).logits is Model.logits

    def cache_shape(self, batch: md.Dim, memory: md.Dim) -> list[md.Dim]:
        """The dims of the cached keys (and values) of ``batch`` sequences of ``memory`` positions:
        ``[layers, batch, heads, memory, d_kv]`` (``kv_heads`` for grouped-query attention)."""
        return [self.layers, batch, self.attention.kv_heads or self.attention.heads, memory, self.attention.d_kv]

    def decode(
        self, params: dict[str, Any], tokens: md.Tensor, cache: dict[str, md.Tensor], step: dict[str, md.Tensor]
    ) -> tuple[md.Tensor, dict[str, md.Tensor]]:
        """The logits ``[batch, vocab]`` of the last of ``tokens[batch, length]`` and the cache with their keys
        and values written in: prefill (the prompt, at slot 0) or a decode step (one token per row).

        ``cache``: ``{"keys", "values"}``, each of ``cache_shape`` in the compute dtype; ``step``:
        ``{"index", "positions", "valid"}`` as in ``md.nn.KVCache``. The layers are this model's own
        ``_layer`` (the same code as ``logits``), each with its cache.
        """

        def body(x: md.Tensor, layer: tuple) -> tuple[md.Tensor, tuple[md.Tensor, md.Tensor]]:
            p, keys, values = layer
            kv = md.nn.KVCache(keys, values, step["index"], step["positions"], step["valid"])
            return self._layer(x, p, kv), (kv.keys, kv.values)

        layers = (params["layers"], cache["keys"], cache["values"])
        x, (keys, values) = md.scan(body, self.embed(params, tokens), layers, "layers")
        last = md.slice(x, tokens.shape["length"].size - 1, 1, "length")
        logits = md.reduce_sum(self.head(params, last), "length")
        return logits, {"keys": keys, "values": values}

    def loss(self, params: dict[str, Any], batch: dict[str, md.Tensor]) -> md.Tensor:
        """Mean next-token cross-entropy: ``post(layers(pre))``, as ``meshdsl.pipeline`` runs it in stages."""
        x, _ = md.scan(
            lambda x, p: (self.layer(x, p), None),
            self.pre(params, batch),
            params["layers"],
            "layers",
            remat=self.remat,
        )
        return self.post(params, x, batch)

    # The pipeline parts (``meshdsl.pipeline``): embedding, one layer, head and loss.

    @property
    def pipelined(self) -> bool:
        """Whether ``loss`` is ``post(layers(pre))``; a subclass that changes the loss (the MoE) is not."""
        return type(self).loss is Model.loss

    def with_batch(self, size: int) -> Model:
        """This model for batches of ``size`` rows (a pipeline's microbatches)."""
        return type(self)(dataclasses.replace(self.config, batch=size))

    def pre(self, params: dict[str, Any], batch: dict[str, md.Tensor]) -> md.Tensor:
        """The residual stream entering the first layer."""
        return self.embed(params, batch["inputs"])

    def layer(self, x: md.Tensor, p: dict[str, md.Tensor]) -> md.Tensor:
        """One layer, ``p`` its slice of ``params["layers"]``."""
        return self._layer(x, p)

    def post(self, params: dict[str, Any], x: md.Tensor, batch: dict[str, md.Tensor]) -> md.Tensor:
        """The loss of the residual stream leaving the last layer (targets ``IGNORE_INDEX`` left out of the mean)."""
        head = functools.partial(self.head, params)
        size = self.config.loss_chunk
        chunk = size if size > 0 and self.length.size % size == 0 else None
        return md.nn.cross_entropy(
            x, batch["targets"], head, self.vocab, self.length, chunk, ignore_index=self._ignored
        )

    def batch(self, key: jax.Array) -> dict[str, md.Tensor]:
        """A synthetic batch of the task in the module docstring."""
        c = self.config
        start = md.cast(md.random.bits(key, [self.batch_dim]) % c.vocab, jnp.int32)
        position = md.Dim("position", c.length + 1)
        terms = task_terms(c.vocab, position.size)
        powers = md.tensor(jnp.asarray(terms[0], jnp.int32), [position])
        offsets = md.tensor(jnp.asarray(terms[1], jnp.int32), [position])
        tokens = (start * powers + offsets) % c.vocab

        def window(begin: int) -> md.Tensor:
            return md.rename(md.slice(tokens, begin, c.length, "position"), "position", "length")

        return {"inputs": window(0), "targets": window(1)}

    def flops_per_step(self) -> float:
        """Model FLOPs of a training step: 6 x parameters x tokens, plus causal attention (6 x L x B x T^2 x H x d_kv:
        half of full attention's, :func:`meshdsl.planner.flops.attention_flops`)."""
        c = self.config
        per_layer = 4 * c.d_model * c.heads * c.d_kv + 2 * c.d_model * c.d_ff
        params = c.layers * per_layer + c.d_model * c.vocab
        tokens = c.batch * c.length
        return 6 * params * tokens + c.layers * attention_flops(
            c.batch, c.heads, c.length, c.length, c.d_kv, causal=True
        )

    def examples_per_step(self) -> int:
        """Tokens per step."""
        return self.config.batch * self.config.length


def check_remat_policy(name: str) -> None:
    """ConfigError unless ``name`` is one of ``md.scan``'s remat policies."""
    if name not in REMAT_POLICIES:
        raise ConfigError(f"remat_policy must be one of {', '.join(map(repr, REMAT_POLICIES))}, got {name!r}")


def task_terms(vocab: int, n: int) -> tuple[list[int], list[int]]:
    """The synthetic task's ``5^i mod vocab`` and ``3 (1 + 5 + ... + 5^(i-1)) mod vocab`` for ``i < n``, in one
    pass (summing each geometric series anew took ``n^2`` steps: half a minute at the 8B preset's 4,096)."""
    powers, offsets = [], []
    power, total = 1 % vocab, 0
    for _ in range(n):
        powers.append(power)
        offsets.append(3 * total % vocab)
        total = (total + power) % vocab
        power = power * 5 % vocab
    return powers, offsets
