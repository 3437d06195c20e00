"""The spmd lowering: ops on local shards inside one ``shard_map``, collectives emitted by meshdsl.

Each tensor is laid out as the layout's rules say for its shape (plus, possibly, pending partial
sums). Ops move their inputs to the layout their local computation needs and their outputs back
with :mod:`meshdsl.relayout`; reductions over split dims end in ``psum``/``pmax``/``pmin``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshdsl import compression, relayout
from meshdsl.dims import Shape
from meshdsl.jax_compat import aval_varying
from meshdsl.jax_compat import varying_axes as _varying_axes
from meshdsl.layout import Layout, Split
from meshdsl.lowering import relayout_run
from meshdsl.lowering.base import Lowering, exact_max, pmax_total
from meshdsl.mesh import Mesh
from meshdsl.tensor import Tensor


def _pvary(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``x`` marked as varying along ``axes`` (``lax.pcast``; every supported JAX, 0.10 on, has it)."""
    if not axes:
        return x
    return lax.pcast(x, axes, to="varying")


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _vary_summing_grads_in(x: jax.Array, axes: tuple[str, ...], dtype: Any) -> jax.Array:
    """``x`` marked varying along ``axes``; its gradient, summed over them, is summed in ``dtype``.

    A JVP, not a VJP: the tangent passes through ``dtype``, so the transpose (the gradient) casts,
    sums over ``axes`` and casts back. A linear tangent map transposes anywhere, also where this
    runs inside another custom rule's tangent (a custom VJP there could not be transposed).
    Forward-mode tangents are rounded to ``dtype``.
    """
    return _pvary(x, axes)


@_vary_summing_grads_in.defjvp
def _vary_jvp(axes: tuple[str, ...], dtype: Any, primals: tuple, tangents: tuple) -> tuple[jax.Array, jax.Array]:
    (x,), (t,) = primals, tangents
    return _pvary(x, axes), _pvary(t.astype(dtype), axes).astype(t.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _vary_compressing_grads(x: jax.Array, axes: tuple[str, ...], n: int, dtype: Any) -> jax.Array:
    """``x`` marked varying along ``axes`` (``n`` devices); its gradient summed over them by
    :func:`meshdsl.compression.psum`, scaled into ``dtype`` (float16 or 8-bit). A custom VJP: the
    scale makes the sum non-linear, so it cannot run inside another custom rule's tangent (see
    :meth:`SpmdLowering.linear_sums`)."""
    return _pvary(x, axes)


def _compressing_fwd(x: jax.Array, axes: tuple[str, ...], n: int, dtype: Any) -> tuple[jax.Array, None]:
    return _pvary(x, axes), None


def _compressing_bwd(axes: tuple[str, ...], n: int, dtype: Any, _: None, ct: jax.Array) -> tuple[jax.Array]:
    return (compression.psum(ct, axes, n, dtype),)


_vary_compressing_grads.defvjp(_compressing_fwd, _compressing_bwd)


def _renumber(position: int, given: tuple[str, ...], ordered: tuple[str, ...], sizes: dict[str, int]) -> int:
    """A device's position along ``given`` axes (major to minor), as a position along ``ordered``."""
    index = {}
    for a in reversed(given):
        position, index[a] = divmod(position, sizes[a])
    out = 0
    for a in ordered:
        out = out * sizes[a] + index[a]
    return out


class SpmdLowering(Lowering):
    """Local shards on ``mesh``, laid out by ``layout``.

    ``grad_reduce_dtype``: sum gradients across devices in this (narrower) dtype. Where an op meets
    an operand that is replicated along axes its other operands vary along, the operand's gradient
    is a sum over those axes; where a stored shard is gathered (FSDP), its gradient is a
    reduce-scatter. Both cast, sum and cast back (bf16 halves those bytes).
    """

    mesh: Mesh  # always a mesh here (the eager base lowering has none)

    def __init__(self, mesh: Mesh, layout: Layout, grad_reduce_dtype: Any = None):
        self.mesh = mesh
        self.layout = layout
        self.axis_sizes = dict(mesh.axis_sizes)
        self.grad_reduce_dtype = grad_reduce_dtype

    def axes(self, shape: Shape, tensor: str = "tensor") -> Split:
        return self.layout.axes(shape, self.mesh, tensor)

    def _relayout(
        self,
        array: jax.Array,
        shape: Shape,
        src: Split,
        dst: Split,
        pending: Sequence[str],
        varying: frozenset[str] = frozenset(),
    ) -> jax.Array:
        steps = relayout.plan(src, dst, pending, shape.sizes, self.axis_sizes)
        if not steps:
            return array
        with jax.named_scope(str(shape)):
            return relayout_run.apply(array, steps, self.axis_sizes, varying, self.grad_reduce_dtype)

    def prepare(self, t: Tensor, axes: Split | None = None, beside: Sequence[Tensor] = ()) -> jax.Array:
        own = self.axes(t.shape)
        src = self.split_of(t)
        varying = frozenset().union(*(self._varying_when_prepared(o) for o in beside if o is not t))
        x = self._relayout(t._data, t.shape, src, own if axes is None else axes, t.pending, varying)
        missing = tuple(sorted(varying - _varying_axes(x)))
        return self._vary(x, missing) if self._narrow_grads(x, missing) else x

    def _varying_when_prepared(self, t: Tensor) -> frozenset[str]:
        """Split an operand will vary along when an op has prepared it: those it varies along now,
        less the sums it still owes and the splits it holds beyond its rules' layout (a stored
        FSDP parameter, which its gather makes replicated along those axes), plus every axis its
        rules split it along (a replicated operand, such as a tensor the function closes over, is
        sliced to its block there: the slice varies)."""
        held = {a for axes in self.split_of(t) for a in axes}
        ruled = {a for axes in self.axes(t.shape) for a in axes}
        return (_varying_axes(t._data) - set(t.pending) - (held - ruled)) | ruled

    def stored_gather(self, shape: Shape, axes: Split) -> tuple[int, tuple[str, ...]] | None:
        steps = relayout.plan(axes, self.axes(shape), (), shape.sizes, self.axis_sizes)
        if len(steps) == 1 and steps[0].kind is relayout.StepKind.ALL_GATHER:
            return steps[0].dim, steps[0].axes
        return None

    def gather_stored(
        self, arrays: list[jax.Array], gathers: Sequence[tuple[int, tuple[str, ...]] | None], *others: jax.Array
    ) -> list[jax.Array]:
        varying = frozenset().union(*(_varying_axes(o) for o in others))
        # One group per gather axes, dtype and manual-axis type: concatenating shards that vary along
        # different axes would make every part vary along them all.
        groups: dict[tuple[tuple[str, ...], Any, frozenset[str]], list[tuple[int, int]]] = {}
        for i, g in enumerate(gathers):
            if g is not None:
                groups.setdefault((g[1], arrays[i].dtype, _varying_axes(arrays[i])), []).append((i, g[0]))
        out = list(arrays)
        for (axes, _, _), members in groups.items():
            to = "varying" if varying.issuperset(axes) else "invarying"
            with jax.named_scope(f"[{len(members)} stored tensors]"):
                gathered = relayout_run.gather_together(
                    [arrays[i] for i, _ in members],
                    [dim for _, dim in members],
                    axes,
                    self.group_size(axes),
                    to,
                    self.grad_reduce_dtype,
                )
            for (i, _), a in zip(members, gathered):
                out[i] = a
        return out

    def _narrow_grads(self, x: jax.Array, axes: tuple[str, ...]) -> bool:
        """Whether ``x``'s gradient, summed over ``axes``, is summed in the narrower ``grad_reduce_dtype``."""
        return bool(axes) and relayout.narrower(x.dtype, self.grad_reduce_dtype)

    def _vary(self, x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
        """``x`` marked varying along ``axes``; its gradient summed over them (in ``grad_reduce_dtype``
        where narrower, scaled for float16 and the 8-bit formats)."""
        if not self._narrow_grads(x, axes):
            return _pvary(x, axes)
        dtype = jnp.dtype(self.grad_reduce_dtype)
        if compression.scaled(dtype):
            return _vary_compressing_grads(x, axes, self.group_size(axes), dtype)
        return _vary_summing_grads_in(x, axes, dtype)

    def linear_sums(self) -> SpmdLowering:
        """This lowering, for a custom rule's tangent: JAX transposes a tangent only through linear
        maps, so a scaled ``grad_reduce_dtype`` (float16, 8-bit) sums there in full precision."""
        return SpmdLowering(self.mesh, self.layout, None) if compression.scaled(self.grad_reduce_dtype) else self

    def finish(self, array, shape, axes=None, pending=(), lazy=False, tensor="output") -> Tensor:
        own = self.axes(shape, tensor)
        src = own if axes is None else axes
        if lazy and src == own:
            return Tensor(array, shape, tuple(pending), own)
        return Tensor(self._relayout(array, shape, src, own, pending), shape, (), own)

    def keep(self, array: jax.Array, shape: Shape, axes: Split) -> Tensor:
        return Tensor(array, shape, (), axes)

    def attention_strategy(self, memory: str) -> str:
        return self.layout.attention_strategy(self.layout.axes_of(memory))

    def with_layout(self, layout: Layout) -> SpmdLowering:
        return SpmdLowering(self.mesh, layout, self.grad_reduce_dtype)

    def zeros_traced(self, like: Any) -> jax.Array:
        return _pvary(jnp.zeros(like.shape, like.dtype), tuple(sorted(aval_varying(like))))

    def vary_like(self, x: jax.Array, *others: jax.Array) -> jax.Array:
        missing = frozenset().union(*(_varying_axes(o) for o in others)) - _varying_axes(x)
        return _pvary(x, tuple(sorted(missing)))

    def vary_operand(self, x: jax.Array, *others: jax.Array) -> jax.Array:
        missing = frozenset().union(*(_varying_axes(o) for o in others)) - _varying_axes(x)
        return self._vary(x, tuple(sorted(missing)))

    def group_size(self, axes: Sequence[str]) -> int:
        return relayout.group_size(axes, self.axis_sizes)

    def axis_index(self, axes: Sequence[str]) -> Any:
        return relayout_run.axis_index(axes, self.axis_sizes) if axes else 0

    def reduce_max(self, x: jax.Array, positions: tuple[int, ...], axes: Sequence[str]) -> jax.Array:
        local = int(np.prod([x.shape[p] for p in positions], dtype=int))
        _, offset = self.shard(local * self.group_size(axes), axes)
        return exact_max(x, offset, positions, tuple(axes))

    def pmax(self, x: Any, axes: Sequence[str]) -> Any:
        return pmax_total(x, tuple(axes)) if axes else x

    def pmin(self, x: Any, axes: Sequence[str]) -> Any:
        return lax.pmin(x, tuple(axes)) if axes else x

    def all_gather(self, x: jax.Array, axes: Sequence[str], dim: int) -> jax.Array:
        return lax.all_gather(x, tuple(axes), axis=dim, tiled=True, to="invarying") if axes else x

    def ppermute(
        self, x: jax.Array, axes: Sequence[str], shift: int, wrap: bool, sources: Sequence[int] | None = None
    ) -> jax.Array:
        n = self.group_size(axes)
        if (shift == 0 or (wrap and shift % n == 0)) and sources is None:
            return x
        pairs = [(i, i + shift) for i in range(n) if sources is None or i in sources]
        return self.permute(x, axes, [(i, j % n) for i, j in pairs if wrap or 0 <= j < n])

    def permute(self, x: jax.Array, axes: Sequence[str], pairs: Sequence[tuple[int, int]]) -> jax.Array:
        if not pairs:
            return jnp.zeros_like(x)
        # Our positions run over ``axes`` as given (major to minor); lax numbers the devices of a
        # tuple of axes in mesh order.
        ordered = tuple(a for a in self.mesh.axis_names if a in axes)
        to_lax = [_renumber(i, tuple(axes), ordered, self.axis_sizes) for i in range(self.group_size(axes))]
        return lax.ppermute(x, ordered, perm=[(to_lax[i], to_lax[j]) for i, j in pairs])
