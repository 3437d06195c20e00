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
too (a custom VJP): it saves the local blocks, the output and each row's maximum and sum, never
gathered keys; the keys' and values' gradients travel with their blocks and arrive home after
``n`` permutes. Under a causal mask the work is balanced: the op reorders the sequence into
``2 n`` chunks, device ``i`` holding chunks ``i`` and ``2 n - 1 - i`` (zigzag), so that after its
own block each step computes exactly half a block on every device, with static shapes; the pairs
of chunks the mask hides entirely are not computed (their only effect, on a row every key of
which is masked, is added in O(S H)). The output is put back in the layout's order.

Masked logits are ``MASKED`` (finite, as in ``jax.nn.dot_product_attention``), so a row whose every
key is masked averages every value, as on one device.

``all_to_all`` (DeepSpeed-Ulysses, Jacobs et al., 2023): one ``lax.all_to_all`` per operand moves
the split from the sequence to the heads (the key/value heads where the devices divide them, else
the query groups, the keys and values then gathered), attention runs on whole sequences per head
group (the fused kernel where it applies), and one more all-to-all moves the result back.
"""

from __future__ import annotations

import copy
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


def _half(x: jax.Array, which: int, axis: int) -> jax.Array:
    """The first (0) or second (1) half of ``x`` along ``axis``; ``x`` itself where that dim is 1 (broadcast)."""
    if x.shape[axis] == 1:
        return x
    c = x.shape[axis] // 2
    return lax.slice_in_dim(x, which * c, (which + 1) * c, axis=axis)


def _halves(xs: Any, axis: int) -> tuple[Any, Any]:
    """Every array of the pytree ``xs`` cut in two along ``axis``."""
    return jax.tree.map(lambda x: _half(x, 0, axis), xs), jax.tree.map(lambda x: _half(x, 1, axis), xs)


def _join(lo: Any, hi: Any, axis: int) -> Any:
    return jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=axis), lo, hi)


def _pick(flag: jax.Array, a: Any, b: Any) -> Any:
    """``a`` where ``flag`` else ``b``, array by array (a select: no FLOPs beside the products)."""
    return jax.tree.map(lambda x, y: jnp.where(flag, x, y), a, b)


def _mask_block(mask: jax.Array, rows: int, keys: int) -> jax.Array:
    """The ``rows`` half of a ``[B, K, G, T, S]`` mask's queries and the ``keys`` half of its keys."""
    return _half(_half(mask, rows, 3), keys, 4)


class _Ring:
    """One ring attention's static facts: the axes, their size, this device's position, the scale, the mask kind."""

    def __init__(self, lowering: Lowering, axes: Sequence[str], scale: float, causal: bool):
        self.lowering, self.axes, self.scale, self.causal = lowering, tuple(axes), scale, causal
        self.n = lowering.group_size(self.axes)
        self.me = lowering.axis_index(self.axes)

    def at(self, me: jax.Array) -> _Ring:
        """This ring seen from position ``me`` (an operand of the custom VJP)."""
        other = copy.copy(self)
        other.me = me
        return other

    def send(self, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        """``xs`` to the next device along the ring (each one a collective permute)."""
        return tuple(self.lowering.ppermute(x, self.axes, 1, wrap=True) for x in xs)

    def positions(self, size: int) -> jax.Array:
        """The global positions of this device's ``size`` rows in the balanced (zigzag) order: chunks
        ``me`` and ``2 n - 1 - me`` of ``2 n``."""
        c = size // 2
        return jnp.concatenate([self.me * c + jnp.arange(c), (2 * self.n - 1 - self.me) * c + jnp.arange(c)])

    def owner(self, chunk: int) -> int:
        """The device holding ``chunk`` (of ``2 n``) in the zigzag order."""
        return chunk if chunk < self.n else 2 * self.n - 1 - chunk

    def zigzag(self, x: jax.Array, axis: int) -> jax.Array:
        """``x``'s block along ``axis`` (chunks ``2 me`` and ``2 me + 1`` of ``2 n``, contiguous) in the
        zigzag order: two permutes, one per half."""
        lo, hi = _halves(x, axis)
        lw, n = self.lowering, self.n
        from_lo = lw.permute(lo, self.axes, [(i, self.owner(2 * i)) for i in range(n)])
        from_hi = lw.permute(hi, self.axes, [(i, self.owner(2 * i + 1)) for i in range(n)])
        even = self.me % 2 == 0
        return _join(_pick(even, from_lo, from_hi), _pick(even, from_hi, from_lo), axis)

    def unzigzag(self, x: jax.Array, axis: int) -> jax.Array:
        """:meth:`zigzag` undone."""
        first, second = _halves(x, axis)
        even = self.me % 2 == 0
        lw, n = self.lowering, self.n
        lo = lw.permute(_pick(even, first, second), self.axes, [(self.owner(2 * i), i) for i in range(n)])
        hi = lw.permute(_pick(even, second, first), self.axes, [(self.owner(2 * i + 1), i) for i in range(n)])
        return _join(lo, hi, axis)

    def scores(self, q: jax.Array, k: jax.Array, allowed: jax.Array) -> jax.Array:
        s = jnp.einsum("bkgth,bskh->bkgts", q, k, preferred_element_type=F32) * self.scale
        return jnp.where(allowed, s, MASKED)

    def diagonal(self, mask: jax.Array, size: int) -> jax.Array:
        """``mask`` and, under a causal mask, the causal pairs of this device's own block (zigzag order)."""
        if not self.causal:
            return mask
        pos = self.positions(size)
        return jnp.logical_and(mask, pos[:, None] >= pos[None, :])


def _merge(state: tuple, s: jax.Array, v: jax.Array) -> tuple:
    """The online softmax's running ``(m, den, o)`` with one block's scores ``s`` and values ``v``.

    The block's sum of probabilities comes out of the same product as its output (a column of ones
    beside the values): XLA would otherwise fuse every step's sum into one reduction at the end,
    keeping every step's probabilities alive."""
    m, den, o = state
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    a = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[..., None])
    ones = jnp.ones((*v.shape[:-1], 1), F32)
    pv = jnp.einsum("bkgts,bskh->bkgth", p, jnp.concatenate([v.astype(F32), ones], axis=-1))
    return m_new, den * a + pv[..., -1], o * a[..., None] + pv[..., :-1]


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
    if causal:
        if q.shape[1] % 2:
            raise LayoutError(
                f"causal ring attention over mesh axes {ring.axes} balances the work in {2 * ring.n} chunks of the "
                f"sequence: its length {q.shape[1] * ring.n} must be divisible by {2 * ring.n}"
            )
        q, k, v = (ring.zigzag(x, 1) for x in (q, k, v))
        for axis in (2, 3):
            mask = mask if mask.shape[axis] == 1 else ring.zigzag(mask, axis)

    # This device's position enters as an operand: a custom VJP must not close over a traced value.
    @jax.custom_vjp
    def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, me: jax.Array) -> jax.Array:
        return _forward(ring.at(me), q, k, v, mask, kv_heads)[0]

    def fwd(q, k, v, mask, me):
        out, stats = _forward(ring.at(me), q, k, v, mask, kv_heads)
        return out, (q, k, v, mask, out, stats, me)

    def bwd(res, d_out):
        q, k, v, mask, out, stats, me = res
        return (*_backward(ring.at(me), q, k, v, mask, out, stats, d_out, kv_heads), None, None)

    attend.defvjp(fwd, bwd)
    out = attend(q, k, v, mask, jnp.asarray(ring.me, jnp.int32))
    return ring.unzigzag(out, 1) if causal else out


def _after(block: tuple | None, done: jax.Array) -> tuple | None:
    """``block``, made to depend on ``done`` (adding a zero computed from it): the next permute waits for
    this step, so at most two steps' logits are alive (XLA would otherwise run every step's products
    as soon as their blocks arrive, and on a CPU removes ``lax.optimization_barrier`` before it schedules)."""
    if block is None:
        return None
    zero = jnp.nan_to_num(jnp.ravel(done)[0] * 0.0, nan=0.0, posinf=0.0, neginf=0.0)
    kb, vb, mb = block
    return kb + zero.astype(kb.dtype), vb + zero.astype(vb.dtype), mb


def _send_block(ring: _Ring, block: tuple) -> tuple:
    """A key/value block (with its mask's memory part, if it has one) sent to the next device."""
    kb, vb, mb = block
    if mb.shape[-1] > 1:
        return ring.send((kb, vb, mb))
    return (*ring.send((kb, vb)), mb)


def _forward(ring: _Ring, q, k, v, mask, kv_heads: int) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """The ring's output ``[B, T, N, H]`` and each row's maximum and sum ``[B, K, G, T]`` (float32; not
    their log-sum-exp, which rounds to the maximum on a row whose every logit is ``MASKED``)."""
    lw = ring.lowering
    qg = _grouped(q, kv_heads)
    m = lw.vary_like(jnp.full(qg.shape[:4], -jnp.inf, F32), qg, k)
    state = (m, jnp.zeros_like(m), lw.vary_like(jnp.zeros(qg.shape, F32), qg, k))
    block: Any = (k, v, _mask5(mask, kv_heads))
    for j in range(ring.n):  # unrolled: XLA's cost analysis counts every step
        arrived = _send_block(ring, block) if j < ring.n - 1 else None  # issued before this step's compute
        state = _forward_step(ring, state, qg, block, j)
        block = _after(arrived, state[0])
    m, den, o = state
    return _ungrouped(o / den[..., None]).astype(q.dtype), (m, den)


def _forward_step(ring: _Ring, state: tuple, qg: jax.Array, block: tuple, j: int) -> tuple:
    """``state`` with the block that arrived at step ``j`` merged in. Causal (zigzag order: this
    device's rows are chunks ``lo = me``, ``hi = 2n-1-me``; the block's keys chunks ``src``,
    ``2n-1-src``): ``hi`` rows see ``lo`` keys; ``lo`` rows never see ``hi`` keys; the other two
    pairs, one visible and one hidden, depend on whether ``src < me``: half a block computed."""
    kb, vb, mb = block
    if not ring.causal or j == 0:
        return _merge(state, ring.scores(qg, kb, ring.diagonal(mb, qg.shape[3])), vb)
    early = (ring.me - j) % ring.n < ring.me  # the block's first chunk precedes this device's
    (q_lo, q_hi), (k_lo, k_hi), (v_lo, v_hi) = _halves(qg, 3), _halves(kb, 1), _halves(vb, 1)
    st_lo, st_hi = _halves(state, 3)
    st_hi = _merge(st_hi, ring.scores(q_hi, k_lo, _mask_block(mb, 1, 0)), v_lo)
    st_lo = _merge_hidden(st_lo, v_hi)
    chosen = _pick(early, _mask_block(mb, 0, 0), _mask_block(mb, 1, 1))
    q_chosen, k_chosen = _pick(early, (q_lo, k_lo), (q_hi, k_hi))
    new = _merge(_pick(early, st_lo, st_hi), ring.scores(q_chosen, k_chosen, chosen), _pick(early, v_lo, v_hi))
    other = _merge_hidden(_pick(early, st_hi, st_lo), _pick(early, v_hi, v_lo))
    return _join(_pick(early, new, other), _pick(early, other, new), 3)


def _block_grads(ring: _Ring, rows: tuple, kb: jax.Array, vb: jax.Array, allowed: jax.Array) -> tuple:
    """``(dq, dk, dv)`` of one block of keys for the ``rows`` ``(q, d_out, m, den, delta)`` (float32)."""
    q, do, m, den, delta = rows
    p = jnp.exp(ring.scores(q, kb, allowed) - m[..., None]) / den[..., None]
    dv = jnp.einsum("bkgts,bkgth->bskh", p, do)
    dp = jnp.einsum("bkgth,bskh->bkgts", do, vb.astype(F32))
    ds = jnp.where(allowed, p * (dp - delta[..., None]), 0.0) * ring.scale
    return jnp.einsum("bkgts,bskh->bkgth", ds, kb.astype(F32)), jnp.einsum("bkgts,bkgth->bskh", ds, q), dv


def _hidden_dv(rows: tuple, like: jax.Array) -> jax.Array:
    """The values' gradient from a block of keys hidden from every one of ``rows``: nonzero only where a
    row's every key is masked (its average then reads these values too)."""
    _, do, m, den, _ = rows
    w = jnp.exp(MASKED - m) / den
    return jnp.broadcast_to(jnp.einsum("bkgt,bkgth->bkh", w, do)[:, None], like.shape)


def _backward(ring: _Ring, q, k, v, mask, out, stats, d_out, kv_heads: int) -> tuple[jax.Array, ...]:
    """``(dq, dk, dv)``: the ring again, the keys' and values' gradients travelling with their blocks."""
    m, den = stats
    qg = _grouped(q, kv_heads).astype(F32)
    do = _grouped(d_out, kv_heads).astype(F32)
    delta = jnp.sum(do * _grouped(out, kv_heads).astype(F32), axis=-1)  # [B, K, G, T]
    rows = (qg, do, m, den, delta)
    dq = ring.lowering.vary_like(jnp.zeros(qg.shape, F32), qg, k)
    block: Any = (k, v, _mask5(mask, kv_heads))
    dkv: Any = None
    for j in range(ring.n):
        arrived = _send_block(ring, block) if j < ring.n - 1 else None
        dq, dk_j, dv_j = _backward_step(ring, rows, dq, block, j)
        dkv = (dk_j, dv_j) if dkv is None else (dkv[0] + dk_j, dkv[1] + dv_j)
        dkv = ring.send(dkv)  # on to the device that holds this block next; home after n sends
        block = _after(arrived, dq)
    dk, dv = dkv
    return _ungrouped(dq).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _backward_step(ring: _Ring, rows: tuple, dq: jax.Array, block: tuple, j: int) -> tuple:
    """``dq`` with the block of step ``j`` added, and the block's ``(dk, dv)`` (the pairs of :func:`_forward_step`)."""
    kb, vb, mb = block
    if not ring.causal or j == 0:
        g_q, g_k, g_v = _block_grads(ring, rows, kb, vb, ring.diagonal(mb, dq.shape[3]))
        return dq + g_q, g_k, g_v
    early = (ring.me - j) % ring.n < ring.me
    (r_lo, r_hi), (k_lo, k_hi), (v_lo, v_hi) = _halves(rows, 3), _halves(kb, 1), _halves(vb, 1)
    dq_lo, dq_hi = _halves(dq, 3)
    g_q, dk_lo, dv_lo = _block_grads(ring, r_hi, k_lo, v_lo, _mask_block(mb, 1, 0))
    dq_hi = dq_hi + g_q
    dv_hi = _hidden_dv(r_lo, v_hi)
    chosen = _pick(early, _mask_block(mb, 0, 0), _mask_block(mb, 1, 1))
    k_chosen, v_chosen = _pick(early, (k_lo, v_lo), (k_hi, v_hi))
    g_q, g_k, g_v = _block_grads(ring, _pick(early, r_lo, r_hi), k_chosen, v_chosen, chosen)
    zero_q, zero_k = jnp.zeros_like(g_q), jnp.zeros_like(g_k)
    dq_lo, dq_hi = dq_lo + _pick(early, g_q, zero_q), dq_hi + _pick(early, zero_q, g_q)
    dk_lo, dk_hi = dk_lo + _pick(early, g_k, zero_k), _pick(early, zero_k, g_k)
    other = _hidden_dv(_pick(early, r_hi, r_lo), v_lo)
    dv_lo = dv_lo + _pick(early, g_v, other)
    dv_hi = dv_hi + _pick(early, other, g_v)
    return _join(dq_lo, dq_hi, 3), _join(dk_lo, dk_hi, 1), _join(dv_lo, dv_hi, 1)


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
