"""Attention over a sequence split across devices: the ``ring`` and ``all_to_all`` strategies of a layout's
``[attention]`` table (:data:`meshdsl.layout.ATTENTION_STRATEGIES`).

Both run on the local blocks of the spmd lowering, in ``jax.nn.dot_product_attention``'s layout:
queries ``q[B, T, N, H]`` (``N`` the query heads, key/value head major), keys and values
``k, v[B, S, K, H]`` (``K`` divides ``N``: grouped-query attention), and a boolean mask
``[B, 1 or N, 1 or T, 1 or S]`` (True: attend). The queries' length and the keys' memory are
split over the same mesh axes, ``n`` devices: device ``i`` holds query positions ``[i T, (i+1) T)``
and memory positions ``[i S, (i+1) S)``.

``ring`` (Liu et al., 2023): each device keeps its queries; the key/value blocks (and the mask's
memory part, which travels with them) pass ``n - 1`` times to the next device by ``lax.ppermute``.
Each block is merged into an online softmax (a running maximum ``m``, sum ``den`` and output ``o``
per query, in float32). The next block's permute is issued before the current block is computed,
so a GPU overlaps them; a device holds two key/value blocks at most. The backward pass is a ring
too (a custom VJP): it saves the local blocks, the output and each row's maximum and sum, never gathered
keys; the keys' and values' gradients travel with their blocks and arrive home after ``n``
permutes. Under a causal mask a block wholly in a query block's future is not computed
(``lax.cond``); its only effect, on a row every key of which is masked, is added in O(S H).

Masked logits are ``MASKED`` (finite, as in ``jax.nn.dot_product_attention``), so a row whose every
key is masked averages every value, as on one device.

``all_to_all`` (DeepSpeed-Ulysses, Jacobs et al., 2023): one ``lax.all_to_all`` per operand moves
the split from the sequence to the heads (the key/value heads where the devices divide them, else
the query groups, the keys and values then gathered), attention runs on whole sequences per head
group (the fused kernel where it applies), and one more all-to-all moves the result back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshdsl.errors import LayoutError
from meshdsl.lowering.base import Lowering

MASKED = -0.7 * float(np.finfo(np.float32).max)
"""The logit of a masked pair: ``jax.nn.dot_product_attention``'s large negative number."""
F32 = jnp.float32


def _grouped(x: jax.Array, kv_heads: int) -> jax.Array:
    """``[B, T, N, H]`` as ``[B, K, G, T, H]`` (query head ``n`` reads key/value head ``n // G``)."""
    b, t, n, h = x.shape
    return jnp.transpose(jnp.reshape(x, (b, t, kv_heads, n // kv_heads, h)), (0, 2, 3, 1, 4))


def _ungrouped(x: jax.Array) -> jax.Array:
    b, k, g, t, h = x.shape
    return jnp.reshape(jnp.transpose(x, (0, 3, 1, 2, 4)), (b, t, k * g, h))


def _mask5(mask: jax.Array, kv_heads: int) -> jax.Array:
    """A ``[B, 1 or N, 1 or T, 1 or S]`` mask as ``[B, 1 or K, 1 or G, 1 or T, 1 or S]``."""
    b, n, t, s = mask.shape
    return jnp.reshape(mask, (b, 1, 1, t, s) if n == 1 else (b, kv_heads, n // kv_heads, t, s))


class _Ring:
    """One ring attention's static facts: the axes, their size, the scale and the mask kind."""

    def __init__(self, lowering: Lowering, axes: Sequence[str], scale: float, causal: bool):
        self.lowering, self.axes, self.scale, self.causal = lowering, tuple(axes), scale, causal
        self.n = lowering.group_size(self.axes)

    def send(self, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        """``xs`` to the next device along the ring (each one a collective permute)."""
        return tuple(self.lowering.ppermute(x, self.axes, 1, wrap=True) for x in xs)

    def allowed(self, mask: jax.Array, me: Any, src: Any, t: int, s: int, diagonal: bool) -> jax.Array:
        """Which (query, key) pairs of the block from device ``src`` device ``me`` attends to."""
        if self.causal and diagonal:
            rows = (me * t + jnp.arange(t))[:, None] >= (src * s + jnp.arange(s))[None, :]
            return jnp.logical_and(mask, rows)
        return mask

    def scores(self, q: jax.Array, k: jax.Array, allowed: jax.Array) -> jax.Array:
        s = jnp.einsum("bkgth,bskh->bkgts", q, k, preferred_element_type=F32) * self.scale
        return jnp.where(allowed, s, MASKED)


def _merge(state: tuple, s: jax.Array, v: jax.Array) -> tuple:
    """The online softmax's running ``(m, den, o)`` with one block's scores ``s`` and values ``v``."""
    m, den, o = state
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    a = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[..., None])
    o = o * a[..., None] + jnp.einsum("bkgts,bskh->bkgth", p, v.astype(F32))
    return m_new, den * a + jnp.sum(p, axis=-1), o


def _merge_hidden(state: tuple, v: jax.Array) -> tuple:
    """:func:`_merge` of a block whose every score is ``MASKED``, in O(S H): it counts only in rows
    whose every key so far was masked (their average takes in these values too)."""
    m, den, o = state
    m_new = jnp.maximum(m, MASKED)
    a, b = jnp.exp(m - m_new), jnp.exp(MASKED - m_new)
    total = jnp.sum(v.astype(F32), axis=1)[:, :, None, None, :]  # [B, K, 1, 1, H]
    return m_new, den * a + v.shape[1] * b, o * a[..., None] + b[..., None] * total


def ring_attention(
    lowering: Lowering,
    axes: Sequence[str],
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    scale: float,
    causal: bool,
) -> jax.Array:
    """Attention of the local blocks ``q[B, T, N, H]``, ``k, v[B, S, K, H]`` with the keys split over
    ``axes`` (see the module docstring); the result is ``q``'s block."""
    ring = _Ring(lowering, axes, scale, causal)
    kv_heads = k.shape[2]
    mask = jnp.ones((1, 1, 1, 1), bool) if mask is None else mask
    mask = lowering.vary_like(mask, q, k)

    @jax.custom_vjp
    def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
        return _forward(ring, q, k, v, mask, kv_heads)[0]

    def fwd(q, k, v, mask):
        out, stats = _forward(ring, q, k, v, mask, kv_heads)
        return out, (q, k, v, mask, out, stats)

    def bwd(res, d_out):
        return (*_backward(ring, *res, d_out, kv_heads), None)

    attend.defvjp(fwd, bwd)
    return attend(q, k, v, mask)


def _travels(mask: jax.Array) -> bool:
    """Whether the mask has a memory extent (then its block travels with the keys)."""
    return mask.shape[-1] > 1


def _forward(ring: _Ring, q, k, v, mask, kv_heads: int) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """The ring's output ``[B, T, N, H]`` and each row's maximum and sum ``[B, K, G, T]`` (float32; not
    their log-sum-exp, which rounds to the maximum on a row whose every logit is ``MASKED``)."""
    lw, n = ring.lowering, ring.n
    me = lw.axis_index(ring.axes)
    qg = _grouped(q, kv_heads)
    t, s = qg.shape[3], k.shape[1]
    mask5 = _mask5(mask, kv_heads)
    shape = qg.shape[:4]
    m = lw.vary_like(jnp.full(shape, -jnp.inf, F32), qg, k)
    state = (m, jnp.zeros_like(m), lw.vary_like(jnp.zeros(qg.shape, F32), qg, k))

    def step(state: tuple, block: tuple, j: Any, diagonal: bool) -> tuple:
        kb, vb, mb = block
        src = (me - j) % n

        def visible(state: tuple) -> tuple:
            return _merge(state, ring.scores(qg, kb, ring.allowed(mb, me, src, t, s, diagonal)), vb)

        if not ring.causal or diagonal:
            return visible(state)
        return lax.cond(src < me, visible, lambda st: _merge_hidden(st, vb), state)

    block = (k, v, mask5)
    state = step(state, block, 0, diagonal=True)
    if n > 1:

        def body(carry: tuple, j: Any) -> tuple:
            state, block = carry
            arrived = _send_block(ring, block)  # issued before this step's compute
            return (step(state, arrived, j, diagonal=False), arrived), None

        (state, _), _ = lax.scan(body, (state, block), jnp.arange(1, n))
    m, den, o = state
    out = _ungrouped(o / den[..., None]).astype(q.dtype)
    return out, (m, den)


def _send_block(ring: _Ring, block: tuple) -> tuple:
    """A key/value block (with its mask's memory part, if it has one) sent to the next device."""
    kb, vb, mb = block
    if _travels(mb):
        return ring.send((kb, vb, mb))
    return (*ring.send((kb, vb)), mb)


def _backward(ring: _Ring, q, k, v, mask, out, stats, d_out, kv_heads: int) -> tuple[jax.Array, ...]:
    """``(dq, dk, dv)``: the ring again, the keys' and values' gradients travelling with their blocks."""
    lw, n = ring.lowering, ring.n
    me = lw.axis_index(ring.axes)
    qg = _grouped(q, kv_heads).astype(F32)
    do = _grouped(d_out, kv_heads).astype(F32)
    delta = jnp.sum(do * _grouped(out, kv_heads).astype(F32), axis=-1)  # [B, K, G, T]
    t, s = qg.shape[3], k.shape[1]
    mask5 = _mask5(mask, kv_heads)
    m, den = stats

    def grads(dq: jax.Array, block: tuple, j: Any, diagonal: bool) -> tuple:
        """This block's share: ``dq`` updated, and the block's ``(dk, dv)`` contributions."""
        kb, vb, mb = block
        src = (me - j) % n

        def visible(dq: jax.Array) -> tuple:
            allowed = ring.allowed(mb, me, src, t, s, diagonal)
            p = jnp.exp(ring.scores(qg, kb, allowed) - m[..., None]) / den[..., None]
            dv = jnp.einsum("bkgts,bkgth->bskh", p, do)
            dp = jnp.einsum("bkgth,bskh->bkgts", do, vb.astype(F32))
            ds = jnp.where(allowed, p * (dp - delta[..., None]), 0.0) * ring.scale
            dq = dq + jnp.einsum("bkgts,bskh->bkgth", ds, kb.astype(F32))
            return dq, jnp.einsum("bkgts,bkgth->bskh", ds, qg), dv

        def hidden(dq: jax.Array) -> tuple:
            w = jnp.exp(MASKED - m) / den  # nonzero only on rows whose every key is masked
            dv = jnp.einsum("bkgt,bkgth->bkh", w, do)[:, None]
            return dq, jnp.zeros(kb.shape, F32), jnp.broadcast_to(dv, kb.shape)

        if not ring.causal or diagonal:
            return visible(dq)
        return lax.cond(src < me, visible, lambda d: tuple(lw.vary_like(x, qg, kb) for x in hidden(d)), dq)

    block = (k, v, mask5)
    dq = lw.vary_like(jnp.zeros(qg.shape, F32), qg, k)
    dq, dk, dv = grads(dq, block, 0, diagonal=True)
    if n > 1:
        dk, dv = ring.send((dk, dv))

        def body(carry: tuple, j: Any) -> tuple:
            dq, block, dk, dv = carry
            arrived = _send_block(ring, block)
            dq, dk_j, dv_j = grads(dq, arrived, j, diagonal=False)
            dk, dv = ring.send((dk + dk_j, dv + dv_j))
            return (dq, arrived, dk, dv), None

        (dq, _, dk, dv), _ = lax.scan(body, (dq, block, dk, dv), jnp.arange(1, n))
    return _ungrouped(dq).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def ulysses_attention(
    lowering: Lowering,
    axes: Sequence[str],
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    attend: Any,
    heads: tuple[str, int, int],
) -> jax.Array:
    """DeepSpeed-Ulysses: ``attend(q, k, v, mask, causal_from_zero)`` on whole sequences of a share of
    the heads (see the module docstring). ``heads``: the key/value heads' name and size and the
    query group size, for the error when the devices divide neither."""
    n = lowering.group_size(axes)
    axes = tuple(axes)
    kv_heads, queries = k.shape[2], q.shape[2]
    group = queries // kv_heads
    name, kv_total, group_total = heads
    if kv_heads % n == 0:  # each device a share of the key/value heads and their query groups
        q2 = lax.all_to_all(q, axes, 2, 1, tiled=True)
        k2, v2 = (lax.all_to_all(x, axes, 2, 1, tiled=True) for x in (k, v))
    elif group % n == 0:  # each device a share of every key/value head's query group; keys gathered
        b, t, _, h = q.shape
        q2 = lax.all_to_all(jnp.reshape(q, (b, t, kv_heads, group, h)), axes, 3, 1, tiled=True)
        q2 = jnp.reshape(q2, (b, t * n, kv_heads * group // n, h))
        k2, v2 = (lax.all_gather(x, axes, axis=1, tiled=True) for x in (k, v))
    else:
        raise LayoutError(
            f"all_to_all attention over mesh axes {axes} ({n} devices) needs {n} to divide the key/value heads "
            f"{name} ({kv_heads}) or each one's query heads ({group}), as held on each device "
            f"({name} of size {kv_total}, {group_total} query heads each)"
        )
    m2 = None
    if mask is not None:
        m2 = mask
        for dim in (2, 3):  # the mask's length and memory, gathered whole (boolean: small beside the keys)
            if m2.shape[dim] > 1:
                m2 = lax.all_gather(m2, axes, axis=dim, tiled=True)
        if m2.shape[1] > 1:  # over the heads: this device's share
            m2 = _own_heads(lowering, axes, m2, kv_heads % n == 0, kv_heads, group)
    out = attend(q2, k2, v2, m2)
    if kv_heads % n == 0:
        return lax.all_to_all(out, axes, 1, 2, tiled=True)
    b, t, _, h = out.shape
    out = lax.all_to_all(jnp.reshape(out, (b, t, kv_heads, group // n, h)), axes, 1, 3, tiled=True)
    return jnp.reshape(out, (b, t // n, kv_heads * group, h))


def _own_heads(lowering: Lowering, axes: tuple[str, ...], m: jax.Array, by_kv: bool, kv_heads: int, group: int):
    """The heads of a ``[B, N, T, S]`` mask this device attends for after the all-to-all."""
    n = lowering.group_size(axes)
    me = lowering.axis_index(axes)
    b, _, t, s = m.shape
    m5 = jnp.reshape(m, (b, kv_heads, group, t, s))
    if by_kv:
        m5 = lax.dynamic_slice_in_dim(m5, me * (kv_heads // n), kv_heads // n, axis=1)
    else:
        m5 = lax.dynamic_slice_in_dim(m5, me * (group // n), group // n, axis=2)
    return jnp.reshape(m5, (b, -1, t, s))
