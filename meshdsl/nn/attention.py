"""``MultiHeadAttention``: self-attention with one fused query/key/value projection."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from meshdsl.dims import Dim
from meshdsl.errors import ShapeError
from meshdsl.nn.attention_core import dot_product_attention
from meshdsl.nn.linear import Linear
from meshdsl.nn.params import Stack, cast_like, check_has
from meshdsl.ops.concat import unstack
from meshdsl.ops.einsum import einsum
from meshdsl.ops.reshape import rename
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

    ``causal``: position ``i`` attends to positions ``<= i``. ``__call__``'s ``mask``: a boolean
    tensor over some of ``batch``, ``heads``, ``length``, ``memory`` (True: attend), e.g. a padding
    mask ``[batch, memory]``. ``implementation``: "xla" or "cudnn" (see ``jax.nn.dot_product_attention``);
    None (the default) chooses cuDNN's fused attention where the shard's dtype, head size and mask
    allow it on a GPU, XLA's formula otherwise (:mod:`meshdsl.nn.attention_impl`).

    Params: ``{"wqkv": qkv_projection's, "wo": output_projection's}`` (``Linear`` weights, LeCun
    normal).
    """

    model: Dim
    heads: Dim
    d_kv: Dim
    _: dataclasses.KW_ONLY
    length: str = "length"
    memory: str = "memory"
    fused: str = "qkv"
    causal: bool = False
    implementation: str | None = None

    def __post_init__(self) -> None:
        names = [self.model.name, self.heads.name, self.d_kv.name, self.length, self.memory, self.fused]
        if len(set(names)) != len(names):
            raise ShapeError(f"MultiHeadAttention: dim names {names} must be distinct")

    @property
    def qkv_projection(self) -> Linear:
        """``model -> [qkv, heads, d_kv]``."""
        return Linear(self.model, [Dim(self.fused, 3), self.heads, self.d_kv])

    @property
    def output_projection(self) -> Linear:
        """``[heads, d_kv] -> model``."""
        return Linear([self.heads, self.d_kv], self.model)

    def init(self, key: jax.Array, stack: Stack = ()) -> dict[str, Tensor]:
        k_qkv, k_out = jax.random.split(key)
        return {"wqkv": self.qkv_projection.init(k_qkv, stack), "wo": self.output_projection.init(k_out, stack)}

    def __call__(self, params: dict[str, Any], x: Tensor, *, mask: Tensor | None = None) -> Tensor:
        check_has("MultiHeadAttention", x, [self.model], "model")
        if self.length not in x.shape:
            raise ShapeError(f"MultiHeadAttention: input {x.shape} has no length dim {self.length!r}")
        batch = [d for d in x.shape if d.name not in (self.length, self.model.name)]
        # Dims ordered as the matmuls want them (heads before length): no transposes between them.
        out = [Dim(self.fused, 3), *batch, self.heads, x.shape[self.length], self.d_kv]
        q, k, v = unstack(einsum(x, cast_like(params["wqkv"], x), out=out), self.fused)
        k, v = rename(k, self.length, self.memory), rename(v, self.length, self.memory)
        attended = dot_product_attention(
            q, k, v, heads=self.heads, length=self.length, memory=self.memory, depth=self.d_kv,
            causal=self.causal, mask=mask, implementation=self.implementation,
        )
        return self.output_projection(params["wo"], attended)
