"""``dot_product_attention``: softmax(q k / sqrt(d)) v by dim name, run by ``jax.nn.dot_product_attention``
on each shard.

Queries ``q[*batch, heads, length, d_kv]`` (any order), keys and values ``[*batch, heads, memory,
d_kv]``; the result has ``q``'s shape. ``batch`` is every other dim, shared by all three.

Grouped-query and multi-query attention (Ainslie et al., 2023; Shazeer, 2019): a dim of the
queries that the keys lack (``q[batch, kv_heads, group, length, d_kv]`` with ``heads="kv_heads"``)
is a group of query heads sharing one key/value head (``kv_heads`` of size 1: multi-query). The
kernel gets the ``heads`` and group dims flattened into its head axis, key/value head major
(query head ``n`` reads key/value head ``n // group``), which ``jax.nn.dot_product_attention``
takes with fewer key/value heads than query heads: the fused call, whichever of the two is split.

Where the keys' ``memory`` dim is whole on every device, each device runs
``jax.nn.dot_product_attention`` on its local blocks, laid out as it wants them (``[B, T, N, H]``:
the batch dims flattened, then query length, heads, depth), with no communication:

* ``batch`` dims split (data parallel) and ``heads`` split (Megatron): each device attends its
  own rows and heads;
* ``length`` split (the queries): each device attends its own queries to every key; the causal
  mask is built for its rows' global positions (``lowering.shard``);
* ``d_kv`` split: gathered first (the sum over it belongs to one device).

Inside the spmd lowering these blocks are the device's own arrays, so ``implementation="cudnn"``
gives each GPU cuDNN's fused attention. JAX's own default, None, is XLA's formula on every
backend (0.10 to 0.12); meshdsl's None chooses per shard (:mod:`meshdsl.nn.attention_impl`). On
the gspmd backend and eagerly the same call runs on the global arrays (XLA partitions it by the
sharding constraints).

When ``memory`` is split, a device holds only some keys of each query: it computes the einsum
formulation with md ops instead (``einsum``, a masked ``softmax`` over the split dim, which costs
one ``pmax`` and one ``psum``, and an ``einsum`` whose sum over ``memory`` stays pending).

Masks: ``causal`` (query ``i`` sees memory positions ``j <= i``) and ``mask``, a boolean tensor
over some of ``batch``, ``heads``, ``length``, ``memory`` (True: attend; a padding mask is
``[batch, memory]``). As in ``jax.nn.dot_product_attention``, masked logits become
``-0.7 * float32 max``, and the softmax runs in float32.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from meshdsl.arguments import number
from meshdsl.dims import DimLike, Shape
from meshdsl.errors import LayoutError, ShapeError
from meshdsl.lowering.context import current, op
from meshdsl.nn import fused_attention_standin
from meshdsl.nn.attention_impl import implementation_here, needs_standin
from meshdsl.nn.context_attention import MASKED, ring_attention, ulysses_attention
from meshdsl.nn.params import check_float
from meshdsl.ops import elementwise
from meshdsl.ops.einsum import einsum
from meshdsl.ops.indexing import range as md_range
from meshdsl.ops.reduction import softmax
from meshdsl.tensor import Tensor


def _name(d: DimLike) -> str:
    return d if isinstance(d, str) else d.name


def _check(
    q: Tensor, k: Tensor, v: Tensor, h: str, t: str, s: str, d: str, mask: Tensor | None
) -> tuple[list[str], list[str]]:
    """The batch dims and the query-group dims, in ``q``'s order; ShapeError when the operands do not fit together."""
    if t == s:
        raise ShapeError(
            f"dot_product_attention: the query length and memory dims need distinct names, got {t!r} twice",
            op="dot_product_attention",
        )
    for x, role, need in ((q, "query", (h, t, d)), (k, "key", (h, s, d)), (v, "value", (h, s, d))):
        missing = [n for n in need if n not in x.shape]
        if missing:
            raise ShapeError(
                f"dot_product_attention: {role} {x.shape} lacks dims {missing}", op="dot_product_attention"
            )
    if set(k.shape) != set(v.shape):
        raise ShapeError(
            f"dot_product_attention: keys {k.shape} and values {v.shape} must have the same dims",
            op="dot_product_attention",
        )
    batch = [n for n in q.names if n not in (h, t, d) and n in k.shape]
    groups = [n for n in q.names if n not in (h, t, d) and n not in k.shape]
    if {x for x in q.shape if x.name in batch} | {q.shape[h], q.shape[d]} != {x for x in k.shape if x.name != s}:
        also = f" (and the query groups {groups})" if groups else ""
        raise ShapeError(
            f"dot_product_attention: queries {q.shape} and keys {k.shape} differ in dims other than {t} and {s}{also}",
            op="dot_product_attention",
        )
    if len({jnp.dtype(q.dtype), jnp.dtype(k.dtype), jnp.dtype(v.dtype)}) > 1:
        raise ShapeError(
            f"dot_product_attention: queries ({jnp.dtype(q.dtype).name}), keys ({jnp.dtype(k.dtype).name}) and "
            f"values ({jnp.dtype(v.dtype).name}) must have one dtype; md.cast them to the one you mean"
        )
    if mask is not None:
        allowed = {*batch, *groups, h, t, s}
        if mask.dtype != jnp.bool_ or not set(mask.names) <= allowed:
            raise ShapeError(
                f"dot_product_attention: mask {mask.shape} ({mask.dtype}) must be boolean over dims of "
                f"{sorted(allowed)}",
                op="dot_product_attention",
            )
        sizes = {**{x.name: x for x in k.shape}, **{x.name: x for x in q.shape}}
        other = [f"{x} (the inputs' {sizes[x.name]})" for x in mask.shape if sizes[x.name].size != x.size]
        if other:
            raise ShapeError(f"dot_product_attention: mask {mask.shape} has {', '.join(other)}")
    return batch, groups


@op("dot_product_attention")
def dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    heads: DimLike = "heads",
    length: DimLike = "length",
    memory: DimLike = "memory",
    depth: DimLike = "d_kv",
    causal: bool = False,
    mask: Tensor | None = None,
    scale: float | None = None,
    implementation: str | None = None,
) -> Tensor:
    """Attention of queries ``q`` to keys ``k`` and values ``v`` (see the module docstring).

    ``scale`` multiplies the logits (default ``1 / sqrt(d_kv)``); ``implementation`` is passed to
    ``jax.nn.dot_product_attention`` ("xla" or "cudnn"); None chooses per shard
    (:func:`meshdsl.nn.attention_impl.choose_implementation`: cuDNN's fused kernel on a GPU for
    16-bit inputs, a head size it takes and no mask tensor; XLA's formula otherwise).
    """
    for role, x in (("queries", q), ("keys", k), ("values", v)):
        check_float(f"dot_product_attention {role}", x)
    if scale is not None:
        number(scale, "dot_product_attention: scale", above=0.0, op="dot_product_attention")
    h, t, s, d = map(_name, (heads, length, memory, depth))
    batch, groups = _check(q, k, v, h, t, s, d, mask)
    scale = q.shape[d].size ** -0.5 if scale is None else scale
    lowering = current()
    own = dict(zip(k.names, lowering.axes(k.shape)))
    context = own[s]
    strategy = lowering.attention_strategy(s)
    own.update(zip(q.names, lowering.axes(q.shape)))
    if strategy == "all_gather":
        if context and not set(own[t]) & set(context):
            return _einsum_attention(q, k, v, [*batch, h, *groups], t, s, causal, mask, scale)
        own[s] = ()  # the keys and values gathered whole: each device its queries against all of them
    else:
        _check_context(strategy, t, s, own[t], context, q.shape[t].size, k.shape[s].size, causal)
    own[d] = ()

    def local(x: Tensor, position: str, heads: list[str], others: list[Tensor]) -> jax.Array:
        """``x``'s local block as ``[B, position, N, d_kv]``, ``N`` the ``heads`` dims flattened (kv head major)."""
        a = lowering.prepare(x, tuple(own[n] for n in x.names), beside=others)
        a = jnp.transpose(a, [x.shape.index(n) for n in (*batch, position, *heads, d)])
        return jnp.reshape(a, (math.prod(a.shape[: len(batch)]), a.shape[len(batch)], -1, a.shape[-1]))

    qa, ka, va = local(q, t, [h, *groups], [k, v]), local(k, s, [h], [q, v]), local(v, s, [h], [q, k])
    qa, ka, va = (lowering.vary_like(a, qa, ka, va) for a in (qa, ka, va))
    local_of = {n: q.shape[n].size // lowering.group_size(own[n]) for n in q.names}
    local_batch = [local_of[n] for n in batch]
    rows, offset = lowering.shard(q.shape[t].size, own[t])
    allowed = None
    if mask is not None:
        full = Shape([*(q.shape[n] for n in batch), q.shape[h], *(q.shape[n] for n in groups), q.shape[t], k.shape[s]])
        m = elementwise.align(lowering.prepare(mask, tuple(own[n] for n in mask.names)), mask.shape, full)
        head_sizes = list(m.shape[len(batch) : -2])
        if math.prod(head_sizes) > 1:  # a mask over some of the head dims: over all of them, as the kernel's N
            head_sizes = [local_of[n] for n in (h, *groups)]
        m = jnp.broadcast_to(m, (*local_batch, *head_sizes, *m.shape[-2:]))
        m = jnp.reshape(m, (math.prod(local_batch), math.prod(head_sizes), *m.shape[-2:]))  # [B, N or 1, T or 1, S]
        allowed = lowering.vary_like(m, qa)
    if strategy == "ring":
        out = ring_attention(lowering, context, qa, ka, va, allowed, scale, causal)
    elif strategy == "all_to_all":
        kv_sizes = (h, q.shape[h].size, math.prod(q.shape[n].size for n in groups))

        def whole(qw: jax.Array, kw: jax.Array, vw: jax.Array, mw: jax.Array | None) -> jax.Array:
            return _kernel(qw, kw, vw, mw, scale, causal, implementation)

        out = ulysses_attention(lowering, context, qa, ka, va, allowed, whole, kv_sizes)
    else:
        whole_causal = causal and not own[t]  # JAX's is_causal: query i sees keys j <= i, from position 0
        if causal and own[t]:
            positions = (jnp.arange(rows) + offset)[:, None] >= jnp.arange(k.shape[s].size)[None, :]
            positions = lowering.vary_like(positions[None, None], qa)
            allowed = positions if allowed is None else jnp.logical_and(allowed, positions)
        out = _kernel(qa, ka, va, allowed, scale, whole_causal, implementation)
    out = jnp.reshape(out, (*local_batch, out.shape[1], *(local_of[n] for n in (h, *groups)), out.shape[-1]))
    order = [*batch, t, h, *groups, d]
    out = jnp.transpose(out, [order.index(n) for n in q.names])
    return lowering.finish(out, q.shape, tuple(own[n] for n in q.names))


def _kernel(
    qa: jax.Array,
    ka: jax.Array,
    va: jax.Array,
    allowed: jax.Array | None,
    scale: float,
    causal: bool,
    implementation: str | None,
) -> jax.Array:
    """``jax.nn.dot_product_attention`` on local ``[B, T, N, H]`` blocks, the implementation chosen for
    the shard (or its stand-in where a GPU's kernel is priced on a host without one)."""
    kind = "tensor" if allowed is not None else "causal" if causal else "none"
    chosen = implementation_here(qa.dtype, qa.shape[-1], kind, implementation)
    if needs_standin(chosen):  # priced for a GPU on a host without one (the planner)
        return fused_attention_standin.fused_attention(qa, ka, va, scale, causal)
    return jax.nn.dot_product_attention(qa, ka, va, mask=allowed, scale=scale, is_causal=causal, implementation=chosen)


def _check_context(
    strategy: str, t: str, s: str, rows: tuple[str, ...], keys: tuple[str, ...], length: int, memory: int, causal: bool
) -> None:
    """LayoutError unless the queries' ``t`` is split as the keys' ``s`` (what ``ring`` and ``all_to_all`` assume)."""
    if rows != keys:
        raise LayoutError(
            f"{strategy} attention needs the queries' {t} split over the same mesh axes as the keys' {s}; "
            f"the layout splits {t} over {rows} and {s} over {keys} (give both the same rule, or all_gather)"
        )
    if causal and length != memory:
        raise LayoutError(f"causal {strategy} attention needs {t} (size {length}) and {s} (size {memory}) of one size")


def _as(x: Tensor, dtype: Any) -> Tensor:
    return x if x.dtype == dtype else elementwise.cast(x, dtype)


def _einsum_attention(
    q: Tensor, k: Tensor, v: Tensor, others: list[str], t: str, s: str, causal: bool, mask: Tensor | None, scale: float
) -> Tensor:
    """The same attention in md ops, for a split ``memory`` (``others``: the batch, head and group dims)."""
    logits_dtype = jnp.promote_types(q.dtype, jnp.float32)
    scores = _as(einsum(q, k, out=[*others, t, s]), logits_dtype) * scale
    allowed: Any = None
    if causal:
        allowed = md_range(q.shape[t]) >= md_range(k.shape[s])
    if mask is not None:
        allowed = mask if allowed is None else elementwise.logical_and(allowed, mask)
    if allowed is not None:
        scores = elementwise.where(allowed, scores, MASKED)
    probs = _as(softmax(_as(scores, jnp.float32), s), v.dtype)
    return einsum(probs, v, out=q.shape)
