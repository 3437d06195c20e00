"""``md.nn``: layers to build models from, in named dims (as Mesh-TensorFlow's ``mtf.layers`` and ``haliax.nn``).

A layer is a frozen dataclass that holds only its configuration: its Dims and options, never a
layout. ``layer.init(key, stack=())`` makes its parameters, a pytree of md tensors (a bare tensor
for a one-tensor layer, else a dict naming each part; composite layers nest their parts'),
the same under every layout (``md.random``); ``stack`` dims go in front of every parameter (a
stack of layers for ``md.scan``, or of experts). ``layer(params, x, ...)`` applies it. The layout
lives in config: every layer runs under every layout, and the layout decides which collectives
it costs. See docs/design.md, "md.nn".
"""

from meshdsl.nn.attention import MultiHeadAttention
from meshdsl.nn.attention_core import dot_product_attention
from meshdsl.nn.conv import Conv2d
from meshdsl.nn.cross_entropy import cross_entropy
from meshdsl.nn.dropout import dropout
from meshdsl.nn.embedding import Embedding
from meshdsl.nn.gated_mlp import GatedMLP
from meshdsl.nn.kv_cache import KVCache
from meshdsl.nn.linear import Linear
from meshdsl.nn.mlp import MLP
from meshdsl.nn.moe import MoE
from meshdsl.nn.normalization import LayerNorm, RMSNorm
from meshdsl.nn.position import PositionEmbedding
from meshdsl.nn.rotary import Rotary
from meshdsl.ops.pool import avg_pool, max_pool

__all__ = [
    "avg_pool",
    "Conv2d",
    "cross_entropy",
    "dot_product_attention",
    "KVCache",
    "dropout",
    "Embedding",
    "GatedMLP",
    "LayerNorm",
    "Linear",
    "max_pool",
    "MLP",
    "MoE",
    "MultiHeadAttention",
    "PositionEmbedding",
    "RMSNorm",
    "Rotary",
]
