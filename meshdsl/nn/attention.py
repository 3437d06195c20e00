"""``MultiHeadAttention``: self-attention with one fused query/key/value projection (or a query and a fused
key/value projection for grouped-query attention), optional biases and rotary position embeddings."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from meshdsl.dims import Dim
from meshdsl.errors import ShapeError
from meshdsl.nn.attention_core import dot_product_attention
from meshdsl.nn.kv_cache import KVCache
from meshdsl.nn.linear import Linear
from meshdsl.nn.normalization import RMSNorm
from meshdsl.nn.params import Stack, cast_like, check_float, check_has, check_sizes, dims_of
from meshdsl.nn.rotary import Rotary
from meshdsl.ops.concat import unstack
from meshdsl.ops.einsum import einsum
from meshdsl.ops.elementwise import logical_and
from meshdsl.ops.indexing import range as md_range
from meshdsl.ops.reshape import rename
from meshdsl.ops.update import update_slice
from meshdsl.tensor import Tensor


@dataclasses.dataclass(frozen=True)
class MultiHeadAttention:
    """Self-attention of ``x[*batch, length, model]``, returning the same shape (Vaswani et al., 2017).

    One weight ``wqkv[model, qkv, heads, d_kv]`` projects ``x`` to queries, keys and values at
    once (``x`` meets the weights once, so its gradient is summed once over a split ``heads``);
    keys and values are renamed to ``memory``; ``md.nn.dot_product_attention`` attends (on each
    shard with ``jax.nn.dot_product_attention``; the einsum formulation when ``memory`` is split);
    ``wo[heads, d_kv, model]`` projects back. Splitting ``heads`` is Megatron's attention: the
    projections and the attention are local and the output projection leaves one pending ``psum``.

    ``kv_heads`` (a Dim): grouped-query attention (multi-query at size 1). ``heads`` is then the
    query heads *of each* key/value head (the group; ``kv_heads.size * heads.size`` query heads in
    all): ``wq[model, kv_heads, heads, d_kv]`` makes queries ``[*batch, kv_heads, heads, length,
    d_kv]`` and ``wkv[model, kv, kv_heads, d_kv]`` keys and values ``[*batch, kv_heads, length,
    d_kv]``; ``wo[kv_heads, heads, d_kv, model]``. Query head ``k * heads.size + g`` is Hugging
    Face's ``q_proj`` head of that number. Splitting ``kv_heads`` (or ``heads``) is Megatron's.

    ``bias``: biases on the projections (GPT-2): the projection params become ``Linear``'s
    ``{"kernel", "bias"}``; ``output_bias``, when not None, overrides it for the output projection
    (Qwen2: biases on queries, keys and values only). ``qk_norm``: an ``md.nn.RMSNorm`` over
    ``d_kv`` applied to each head's queries and keys (Qwen3), params ``"q_norm"`` and ``"k_norm"``.
    ``rotary``: an ``md.nn.Rotary`` over ``d_kv``, applied to the queries and keys after ``qk_norm``
    and before the attention (its ``length`` must be this layer's).

    ``causal``: position ``i`` attends to positions ``<= i``. ``__call__``'s ``mask``: a boolean
    tensor over some of ``batch``, ``heads``, ``length``, ``memory`` (True: attend), e.g. a padding
    mask ``[batch, memory]``. ``implementation``: "xla" or "cudnn" (see ``jax.nn.dot_product_attention``);
    None (the default) chooses cuDNN's fused attention where the shard's dtype, head size and mask
    allow it on a GPU, XLA's formula otherwise (:mod:`meshdsl.nn.attention_impl`).

    ``cache``: an ``md.nn.KVCache`` (decoding): the keys and values of ``x``'s positions are written
    into it at ``cache.index``, the queries attend over every valid cached position up to their
    own (``cache.valid``, causality by slot), rotary angles come from ``cache.positions``, and
    ``cache`` holds the updated keys and values afterwards.

    Params: ``{"wqkv": qkv_projection's, "wo": output_projection's}``, or with ``kv_heads``
    ``{"wq", "wkv", "wo"}`` (``Linear`` weights, LeCun normal; with ``bias``, ``{"kernel", "bias"}``).
    """

    model: Dim
    heads: Dim
    d_kv: Dim
    _: dataclasses.KW_ONLY
    length: str = "length"
    memory: str = "memory"
    fused: str = "qkv"
    fused_kv: str = "kv"
    causal: bool = False
    implementation: str | None = None
    kv_heads: Dim | None = None
    bias: bool = False
    output_bias: bool | None = None
    qk_norm: RMSNorm | None = None
    rotary: Rotary | None = None

    def __post_init__(self) -> None:
        check_sizes("MultiHeadAttention", [self.model, self.heads, self.d_kv])
        names = [self.model.name, self.heads.name, self.d_kv.name, self.length, self.memory]
        names += [self.fused] if self.kv_heads is None else [self.fused_kv, self.kv_heads.name]
        if len(set(names)) != len(names):
            raise ShapeError(f"MultiHeadAttention: dim names {names} must be distinct", op="MultiHeadAttention")
        if self.kv_heads is not None and not isinstance(self.kv_heads, Dim):
            raise ShapeError(
                f"MultiHeadAttention: kv_heads must be an md.Dim, got {self.kv_heads!r}", op="MultiHeadAttention"
            )
        if self.kv_heads is not None:
            check_sizes("MultiHeadAttention", [self.kv_heads])
        if self.qk_norm is not None and [d.name for d in dims_of(self.qk_norm.dims)] != [self.d_kv.name]:
            raise ShapeError(f"MultiHeadAttention: qk_norm must be over d_kv {self.d_kv}, got {self.qk_norm.dims}")
        if self.rotary is not None and (self.rotary.depth != self.d_kv or self.rotary.length != self.length):
            raise ShapeError(
                f"MultiHeadAttention: rotary over {self.rotary.depth} and {self.rotary.length!r} "
                f"must be over this layer's d_kv {self.d_kv} and length {self.length!r}",
                op="MultiHeadAttention",
            )

    @property
    def query_heads(self) -> list[Dim]:
        """The head dims of the queries: ``[heads]``, or ``[kv_heads, heads]`` (grouped-query)."""
        return [self.heads] if self.kv_heads is None else [self.kv_heads, self.heads]

    @property
    def qkv_projection(self) -> Linear:
        """``model -> [qkv, heads, d_kv]`` (without ``kv_heads``)."""
        return Linear(self.model, [Dim(self.fused, 3), self.heads, self.d_kv], bias=self.bias)

    @property
    def query_projection(self) -> Linear:
        """``model -> [kv_heads, heads, d_kv]`` (with ``kv_heads``)."""
        return Linear(self.model, [*self.query_heads, self.d_kv], bias=self.bias)

    @property
    def kv_projection(self) -> Linear:
        """``model -> [kv, kv_heads, d_kv]`` (with ``kv_heads``)."""
        if self.kv_heads is None:
            raise ShapeError(
                "MultiHeadAttention: kv_projection is for grouped-query attention (kv_heads); "
                "without kv_heads the keys and values come from qkv_projection",
                op="MultiHeadAttention",
            )
        return Linear(self.model, [Dim(self.fused_kv, 2), self.kv_heads, self.d_kv], bias=self.bias)

    @property
    def output_projection(self) -> Linear:
        """``[heads, d_kv] -> model`` (``[kv_heads, heads, d_kv]`` with ``kv_heads``)."""
        bias = self.bias if self.output_bias is None else self.output_bias
        return Linear([*self.query_heads, self.d_kv], self.model, bias=bias)

    def init(self, key: jax.Array, stack: Stack = ()) -> dict[str, Any]:
        norms = {} if self.qk_norm is None else {n: self.qk_norm.init(None, stack) for n in ("q_norm", "k_norm")}
        if self.kv_heads is None:
            k_qkv, k_out = jax.random.split(key)
            return {
                "wqkv": self.qkv_projection.init(k_qkv, stack),
                "wo": self.output_projection.init(k_out, stack),
                **norms,
            }
        k_q, k_kv, k_out = jax.random.split(key, 3)
        return {
            "wq": self.query_projection.init(k_q, stack),
            "wkv": self.kv_projection.init(k_kv, stack),
            "wo": self.output_projection.init(k_out, stack),
            **norms,
        }

    def _project(self, params: Any, x: Tensor, out: list[Dim]) -> Tensor:
        """``x`` through a projection's weight (and bias), with dims ordered ``out``."""
        w = params["kernel"] if self.bias else params
        y = einsum(x, cast_like(w, x), out=out)
        return y + cast_like(params["bias"], x) if self.bias else y

    def __call__(
        self, params: dict[str, Any], x: Tensor, *, mask: Tensor | None = None, cache: KVCache | None = None
    ) -> Tensor:
        check_float("MultiHeadAttention", x)
        check_has("MultiHeadAttention", x, [self.model], "model")
        if self.length not in x.shape:
            raise ShapeError(
                f"MultiHeadAttention: input {x.shape} has no length dim {self.length!r}", op="MultiHeadAttention"
            )
        batch = [d for d in x.shape if d.name not in (self.length, self.model.name)]
        length = x.shape[self.length]
        # Dims ordered as the matmuls want them (heads before length): no transposes between them.
        if self.kv_heads is None:
            qkv = self._project(params["wqkv"], x, [Dim(self.fused, 3), *batch, self.heads, length, self.d_kv])
            q, k, v = unstack(qkv, self.fused)
        else:
            q = self._project(params["wq"], x, [*batch, *self.query_heads, length, self.d_kv])
            kv = self._project(params["wkv"], x, [Dim(self.fused_kv, 2), *batch, self.kv_heads, length, self.d_kv])
            k, v = unstack(kv, self.fused_kv)
        if self.qk_norm is not None:
            q, k = self.qk_norm(params["q_norm"], q), self.qk_norm(params["k_norm"], k)
        positions = None if cache is None else cache.positions
        if self.rotary is not None:
            q, k = self.rotary(q, positions=positions), self.rotary(k, positions=positions)
        causal = self.causal
        if cache is None:
            k, v = rename(k, self.length, self.memory), rename(v, self.length, self.memory)
        else:
            k, v, mask = self._cached(cache, k, v, length, mask)
            causal = False
        attended = dot_product_attention(
            q,
            k,
            v,
            heads=self.query_heads[0],
            length=self.length,
            memory=self.memory,
            depth=self.d_kv,
            causal=causal,
            mask=mask,
            implementation=self.implementation,
        )
        return self.output_projection(params["wo"], attended)

    def _cached(
        self, cache: KVCache, k: Tensor, v: Tensor, length: Dim, mask: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The step's keys and values written into ``cache`` at ``cache.index`` (which then holds the
        new ones), the whole cache's keys and values, and the mask: valid slots up to each query's own."""
        if self.memory not in cache.keys.shape:
            raise ShapeError(f"MultiHeadAttention: cache keys {cache.keys.shape} have no memory dim {self.memory!r}")
        cache.keys = update_slice(cache.keys, k, cache.index, self.memory, self.length)
        cache.values = update_slice(cache.values, v, cache.index, self.memory, self.length)
        memory = cache.keys.shape[self.memory]
        last = md_range(length) + cache.index if self.causal else cache.index + (length.size - 1)
        seen = md_range(memory) <= last
        allowed = logical_and(cache.valid, seen)
        return cache.keys, cache.values, allowed if mask is None else logical_and(allowed, mask)
