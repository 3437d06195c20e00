"""``KVCache``: one attention layer's keys and values of the positions decoded so far, and where the next go.

The keys and values are md tensors ``[*batch, heads, memory, d_kv]`` (``kv_heads`` for
grouped-query attention), laid out by the layout like any tensor: a split ``batch`` gives each
device its sequences' cache, a split ``heads``/``kv_heads`` its heads' cache, a split ``memory``
part of every sequence's. ``MultiHeadAttention(..., cache=c)`` writes the step's keys and values
at ``c.index`` (``md.ops.update.update_slice``: in place when the buffers are donated), attends
over the whole ``memory`` with ``c.valid`` and causality as the mask, and leaves the new keys and
values in ``c`` (the layer code is the same with or without a cache).
"""

from __future__ import annotations

import dataclasses

from meshdsl.tensor import Tensor


@dataclasses.dataclass
class KVCache:
    """One layer's cache and the step's positions (see the module docstring).

    ``keys``, ``values``: ``[*batch, heads, memory, d_kv]``. ``index``: a 0-d integer tensor, the
    memory slot of the step's first token (all rows step together; left padding aligns them).
    ``positions``: ``[*batch, length]`` integers, each token's position in its own sequence (the
    rotary angle; a left-padded row starts at 0 after its padding). ``valid``: ``[*batch,
    memory]`` booleans, False at padding slots.
    """

    keys: Tensor
    values: Tensor
    index: Tensor
    positions: Tensor
    valid: Tensor
