"""The lowering interface, and its global-array implementation.

Every op is written once, against a local view: it asks the lowering how each dim of its inputs
is split (:meth:`Lowering.axes`), brings its inputs to the layout its local computation needs
(:meth:`Lowering.prepare`), computes on the local arrays, then hands the result over laid out
as it is (:meth:`Lowering.finish`). Collectives over the axes of split dims (``psum`` and
friends) and the device's offset along them complete the op.

Here, on global arrays, no dim is ever split: every axes tuple is empty, the collectives are
identities and offsets are zero, so the same op code computes the plain global result. This is
how meshdsl runs eagerly, and (with sharding constraints added by ``GspmdLowering``) how the
gspmd backend runs. ``SpmdLowering`` gives the same calls their real, per-shard meaning.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from meshdsl.dims import Shape
from meshdsl.relayout import Axes

if TYPE_CHECKING:
    from meshdsl.layout import Layout
    from meshdsl.mesh import Mesh
    from meshdsl.tensor import Tensor


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def exact_max(x: jax.Array, positions: tuple[int, ...], axes: tuple[str, ...]) -> jax.Array:
    """Maximum over ``positions`` of ``x``, whose dims there are split over ``axes`` (inside a
    ``shard_map``; ``()`` on global arrays). Its tangent is the tangent of one maximal entry: the
    first (in flattened index order) on the first device holding a maximum, as ``argmax`` picks.

    Not ``jnp.max``'s rule, which averages over every entry equal to the maximum: finding those
    compares ``x`` with its maximum bit for bit, and XLA may recompute ``x`` inside each fusion
    that reads it, rounding differently in each (XLA:CPU with ``x + jax.random.normal(...)``: the
    normal's polynomial), so under ``jax.jit`` that gradient can come out 0 or NaN (the class of
    jax-ml/jax#40564). Here the entry is found by index, from one reduction that yields each
    device's maximum and its position together; the two rules differ only at exact ties.
    """
    local = jnp.max(x, axis=positions)
    return lax.pmax(local, axes) if axes else local


@exact_max.defjvp
def _exact_max_jvp(positions: tuple[int, ...], axes: tuple[str, ...], primals: tuple, tangents: tuple) -> tuple:
    (x,), (t,) = primals, tangents
    k = len(positions)
    ends = tuple(range(x.ndim - k, x.ndim))
    moved = jnp.moveaxis(x, positions, ends)
    flat = moved.reshape(moved.shape[: x.ndim - k] + (-1,))
    best, index = lax.reduce((flat, lax.broadcasted_iota(jnp.int32, flat.shape, flat.ndim - 1)),
                             (jnp.array(-jnp.inf, flat.dtype), jnp.array(_NO_INDEX, jnp.int32)), _larger_first, (flat.ndim - 1,))
    out = lax.pmax(best, axes) if axes else best
    chosen = lax.broadcasted_iota(jnp.int32, flat.shape, flat.ndim - 1) == index[..., None]
    if axes:  # the first device whose local maximum is the maximum (both from the one reduction above)
        device = lax.axis_index(axes)
        chosen = chosen & (device == lax.pmin(jnp.where(best == out, device, _NO_INDEX), axes))[..., None]
    chosen = jnp.moveaxis(chosen.reshape(moved.shape), ends, positions)
    total = jnp.sum(t * chosen.astype(t.dtype), axis=positions)
    return out, lax.psum(total, axes) if axes else total


_NO_INDEX = jnp.iinfo(jnp.int32).max


def _larger_first(a: tuple, b: tuple) -> tuple:
    """The reduction step of (value, index) pairs keeping the larger value, the lower index on a tie
    (one function object, so JAX traces it once and equal reductions stay equal for XLA's CSE)."""
    (va, ia), (vb, ib) = a, b
    take_a = (va > vb) | ((va == vb) & (ia < ib))
    return lax.select(take_a, va, vb), lax.select(take_a, ia, ib)


class Lowering:
    """Global arrays, nothing split: the eager lowering."""

    mesh: "Mesh | None" = None
    axis_sizes: dict[str, int] = {}

    def axes(self, shape: Shape, tensor: str = "tensor") -> Axes:
        """Per-dim mesh axes that split a tensor of ``shape`` in this lowering's local view."""
        return ((),) * shape.rank

    def layout_of(self, t: "Tensor") -> Axes:
        """How ``t``'s local array is split now (a tensor built outside the lowering is whole)."""
        return t.layout if t.layout is not None else ((),) * t.shape.rank

    def prepare(self, t: "Tensor", axes: Axes | None = None, beside: Sequence["Tensor"] = ()) -> jax.Array:
        """``t``'s local array, laid out as ``axes`` (default: ``t``'s own layout), pending sums added.

        ``beside`` are the op's other operands: splits of ``t`` that are gathered over axes along
        which they vary anyway are gathered so that the gradient is a reduce-scatter.
        """
        return t._data

    def stored_gather(self, shape: Shape, axes: Axes) -> tuple[int, Axes] | None:
        """``(dim, mesh axes)`` when a tensor of ``shape`` held split as ``axes``, another layout than
        the rules give it (a parameter stored split, FSDP), reaches the rules' layout by one
        all-gather along ``dim``; else None."""
        return None

    def gather_stored(self, arrays: list[jax.Array], gathers: Sequence[tuple[int, Axes] | None], *others: jax.Array) -> list[jax.Array]:
        """``arrays`` with each one that has an entry in ``gathers`` gathered as it says, all those over
        the same mesh axes in one collective; ``others``: arrays the results will meet (their
        varying axes make the gradient a reduce-scatter)."""
        return arrays

    def finish(
        self,
        array: jax.Array,
        shape: Shape,
        axes: Axes | None = None,
        pending: Sequence[str] = (),
        lazy: bool = False,
        tensor: str = "output",
    ) -> "Tensor":
        """A Tensor of ``shape`` from a local ``array`` laid out as ``axes`` with ``pending`` sums.

        It is brought to the layout the rules give ``shape``. With ``lazy``, pending sums are kept
        for a later op to add, when the split dims already match.
        """
        from meshdsl.tensor import Tensor

        return Tensor(array, shape)

    def keep(self, array: jax.Array, shape: Shape, axes: Axes) -> "Tensor":
        """A Tensor of ``shape`` from a local ``array`` left laid out as ``axes`` (no relayout)."""
        from meshdsl.tensor import Tensor

        return Tensor(array, shape)

    def hold_whole(self, array: jax.Array, shape: Shape, names: Sequence[str]) -> jax.Array:
        """``array`` (dims ``shape``). Where XLA partitions the program (gspmd) and the layout splits
        one of the dims ``names``: constrained to hold those whole, its other dims as the layout
        says, which keeps XLA's partitioner from a partition it miscomputes (conv2d's windowed
        dims; docs/design.md, gspmd). Elsewhere ``array`` itself."""
        return array

    def with_layout(self, layout: "Layout") -> "Lowering":
        """This lowering under other layout rules (on global arrays: itself)."""
        return self

    def vary_like(self, x: jax.Array, *others: jax.Array) -> jax.Array:
        """``x``, typed as varying along every mesh axis any of ``others`` varies along (for primitives
        that do not unify that themselves)."""
        return x

    def vary_operand(self, x: jax.Array, *others: jax.Array) -> jax.Array:
        """``x``, an operand that ops will meet with ``others``, made varying along their axes once,
        here, rather than by each op: its gradient is then summed over those axes here, once (in
        ``grad_reduce_dtype`` where one is set), as an op's ``prepare`` would."""
        return x

    def group_size(self, axes: Sequence[str]) -> int:
        """Number of devices along ``axes``."""
        return 1

    def axis_index(self, axes: Sequence[str]) -> Any:
        """This device's position along ``axes`` (major to minor)."""
        return 0

    def shard(self, size: int, axes: Sequence[str]) -> tuple[int, Any]:
        """Local length and global offset of this device's block of a dim of ``size`` split over ``axes``."""
        local = size // self.group_size(axes)
        return local, self.axis_index(axes) * local

    def reduce_max(self, x: jax.Array, positions: tuple[int, ...], axes: Sequence[str]) -> jax.Array:
        """Maximum over ``positions`` of ``x``, whose dims there are split over ``axes`` (differentiable, as ``jnp.max``)."""
        return exact_max(x, positions, ())

    def pmax(self, x: Any, axes: Sequence[str]) -> Any:
        """Maximum across ``axes`` (not differentiated: for indices and stopped values)."""
        return x

    def pmin(self, x: Any, axes: Sequence[str]) -> Any:
        return x

    def all_gather(self, x: jax.Array, axes: Sequence[str], dim: int) -> jax.Array:
        return x

    def ppermute(self, x: jax.Array, axes: Sequence[str], shift: int, wrap: bool) -> jax.Array:
        """Send ``x`` to the device ``shift`` places further along ``axes`` (zeros arrive where none is sent)."""
        return x if shift == 0 or wrap else jax.numpy.zeros_like(x)
