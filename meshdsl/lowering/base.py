"""The lowering interface (:class:`Lowering`), and its global-array implementation (:class:`GlobalLowering`).

Every op is written once, against a local view: it asks the lowering how each dim of its inputs
is split (:meth:`Lowering.axes`), brings its inputs to the layout its local computation needs
(:meth:`Lowering.prepare`), computes on the local arrays, then hands the result over laid out
as it is (:meth:`Lowering.finish`). Collectives over the axes of split dims (``psum`` and
friends) and the device's offset along them complete the op.

In :class:`GlobalLowering`, on global arrays, no dim is ever split: every axes tuple is empty, the collectives are
identities and offsets are zero, so the same op code computes the plain global result. This is
how meshdsl runs eagerly, and (with sharding constraints added by ``GspmdLowering``) how the
gspmd backend runs. ``SpmdLowering`` gives the same calls their real, per-shard meaning.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshdsl.dims import Shape

if TYPE_CHECKING:
    from meshdsl.layout import Layout, Split
    from meshdsl.mesh import Mesh
    from meshdsl.tensor import Tensor


NO_INDEX = jnp.iinfo(jnp.int32).max
"""The index a ``pmin`` ignores: what a device contributes when it holds no maximum."""


def order_key(x: jax.Array) -> jax.Array:
    """Integers ordered as ``x``'s values in the total order NaN > +inf > ... > +0.0 > -0.0 > ... > -inf
    (float ``x``: its bits, the negative ones' magnitude bits flipped, every NaN made one positive
    NaN); a non-float ``x`` itself. Maxima taken of keys keep NaN, which ``pmax`` and XLA's
    all-reduce drop on some backends (CPU), so a maximum is the same under every layout. The
    constants are Python scalars (jaxpr literals), so two keys of one value are one computation for
    XLA's CSE and for ``md.explain`` alike."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    ints = np.dtype(f"int{8 * x.dtype.itemsize}")
    nan_bits = int(np.array(np.nan, x.dtype).view(ints))
    bits = lax.select(x != x, lax.full_like(x, 0, ints) + nan_bits, lax.bitcast_convert_type(x, ints))
    return lax.select(bits < 0, bits ^ int(np.iinfo(ints).max), bits)


def from_key(key: jax.Array, dtype: Any) -> jax.Array:
    """The value of ``dtype`` whose :func:`order_key` is ``key``."""
    if not jnp.issubdtype(dtype, jnp.floating):
        return key
    bits = lax.select(key < 0, key ^ int(np.iinfo(key.dtype).max), key)
    return lax.bitcast_convert_type(bits, dtype)


def total_max(x: jax.Array, positions: tuple[int, ...]) -> jax.Array:
    """Maximum over ``positions`` in :func:`order_key`'s order: NaN when any entry is NaN, as ``jnp.max``."""
    return from_key(jnp.max(order_key(x), axis=positions), x.dtype)


def pmax_total(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``lax.pmax`` over ``axes`` in :func:`order_key`'s order: one all-reduce of the keys, which keeps NaN."""
    return from_key(lax.pmax(order_key(x), axes), x.dtype)


def reaches(best: jax.Array, top: jax.Array) -> jax.Array:
    """Where a device's maximum ``best`` is the maximum ``top`` across devices, as ``argmax`` compares
    (equal values, -0.0 equal to +0.0, or both NaN)."""
    if not jnp.issubdtype(best.dtype, jnp.floating):
        return best == top
    return (best == top) | (jnp.isnan(best) & jnp.isnan(top))


def max_and_index(x: jax.Array, positions: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """This device's maximum of ``x`` over ``positions`` and the index (int32, in the flattened
    ``positions``) of its first entry reaching it, from one reduction: the index always points at
    an entry that reduction found largest. NaN counts as largest, as in ``jnp.max``/``jnp.argmax``;
    the maximum of -0.0 and +0.0 is +0.0 (:func:`order_key`), its index the first of them.

    ``md.argmax`` and :func:`exact_max` both call it, so their reductions are one for XLA's CSE
    and for ``md.explain`` alike.
    """
    k = len(positions)
    ends = tuple(range(x.ndim - k, x.ndim))
    moved = jnp.moveaxis(x, positions, ends)
    flat = moved.reshape(moved.shape[: x.ndim - k] + (-1,))
    last = flat.ndim - 1
    iota = lax.broadcasted_iota(jnp.int32, flat.shape, last)
    lowest = (
        -jnp.inf
        if jnp.issubdtype(flat.dtype, jnp.floating)
        else jnp.iinfo(flat.dtype).min
        if jnp.issubdtype(flat.dtype, jnp.integer)
        else False
    )
    return lax.reduce(
        (flat, iota), (jnp.array(lowest, flat.dtype), jnp.array(NO_INDEX, jnp.int32)), _larger_first, (last,)
    )


def _larger_first(a: tuple, b: tuple) -> tuple:
    """The reduction step of (value, index) pairs: the larger value in :func:`order_key`'s order, the
    index of the first entry equal to it (NaN largest, -0.0 equal to +0.0, as ``jnp.argmax``). One
    function object without array constants (the reduction's region stays one for XLA's CSE: an
    :func:`order_key` here kept XLA from merging a recomputed maximum with its forward one), so JAX
    traces it once and equal reductions stay equal."""
    (va, ia), (vb, ib) = a, b
    a_nan, b_nan = va != va, vb != vb
    tie = (va == vb) | (a_nan & b_nan)
    take_a = (a_nan & ~b_nan) | (~b_nan & (va > vb)) | (tie & (ia < ib))
    value = lax.select(take_a, va, vb)
    if jnp.issubdtype(va.dtype, jnp.floating):  # -0.0 and +0.0 tie; their maximum is +0.0, as jnp.max's
        value = lax.select(tie & (va == 0), va + vb, value)
    return value, lax.select(take_a, ia, ib)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def exact_max(x: jax.Array, offset: Any, positions: tuple[int, ...], axes: tuple[str, ...]) -> jax.Array:
    """Maximum over ``positions`` of ``x``, whose dims there are split over ``axes`` (inside a
    ``shard_map``; ``()`` on global arrays). Its tangent is the tangent of one maximal entry: the
    first (in flattened index order) on the first device holding a maximum, as ``argmax`` picks.

    Not ``jnp.max``'s rule, which averages over every entry equal to the maximum: finding those
    compares ``x`` with its maximum bit for bit, and XLA may recompute ``x`` inside each fusion
    that reads it, rounding differently in each (XLA:CPU with ``x + jax.random.normal(...)``: the
    normal's polynomial), so under ``jax.jit`` that gradient can come out 0 or NaN (the class of
    jax-ml/jax#40564). Here the entry is found by index (:func:`max_and_index`); the two rules
    differ only at exact ties. ``offset``: this device's first global index in the flattened
    ``positions`` (0 on global arrays), computed as ``md.argmax`` computes it, so that the
    ``pmin`` choosing the entry is ``md.argmax``'s own when both run (one collective for XLA and
    for ``md.explain``).

    Undifferentiated on global arrays (``axes`` empty: the gspmd backend, or a dim no axis splits)
    it is a plain maximum (of the :func:`order_key` keys, which keep NaN): the GSPMD partitioner
    moves a (value, index) reduction over a split dim as two all-gathers even when nothing reads
    the index, where a maximum is one all-reduce.
    """
    if not axes:
        return total_max(x, positions)
    best, _ = max_and_index(x, positions)
    return pmax_total(best, axes)


@exact_max.defjvp
def _exact_max_jvp(positions: tuple[int, ...], axes: tuple[str, ...], primals: tuple, tangents: tuple) -> tuple:
    (x, offset), (t, _) = primals, tangents
    best, index = max_and_index(x, positions)
    out = pmax_total(best, axes) if axes else best
    if axes:  # the global first maximum, as md.argmax finds it
        index = lax.pmin(jnp.where(reaches(best, out), index + offset, NO_INDEX), axes) - offset
    k = len(positions)
    ends = tuple(range(x.ndim - k, x.ndim))
    moved_shape = jnp.moveaxis(x, positions, ends).shape
    flat_shape = best.shape + (int(np.prod(moved_shape[x.ndim - k :], dtype=int)),)
    chosen = lax.broadcasted_iota(jnp.int32, flat_shape, len(flat_shape) - 1) == index[..., None]
    chosen = jnp.moveaxis(chosen.reshape(moved_shape), ends, positions)
    total = jnp.sum(t * chosen.astype(t.dtype), axis=positions)
    return out, lax.psum(total, axes) if axes else total


class Lowering(abc.ABC):
    """The interface every lowering implements: what an op asks (see the module docstring).

    :class:`GlobalLowering` (eager; with sharding constraints, ``GspmdLowering``) and
    ``SpmdLowering`` implement it; a lowering holds the ``mesh`` it runs on (None on global arrays)
    and its axis sizes.
    """

    mesh: Mesh | None = None
    axis_sizes: dict[str, int] = {}

    @abc.abstractmethod
    def axes(self, shape: Shape, tensor: str = "tensor") -> Split:
        """Per-dim mesh axes that split a tensor of ``shape`` in this lowering's local view."""
        ...

    def split_of(self, t: Tensor) -> Split:
        """How ``t``'s local array is split now, per dim (``t.split``; a tensor built outside the
        lowering is whole): its split, not the ``Layout`` rules' (docs/design.md, vocabulary)."""
        return t.split if t.split is not None else ((),) * t.shape.rank

    @abc.abstractmethod
    def prepare(self, t: Tensor, axes: Split | None = None, beside: Sequence[Tensor] = ()) -> jax.Array:
        """``t``'s local array, laid out as ``axes`` (default: ``t``'s own layout), pending sums added.

        ``beside`` are the op's other operands: splits of ``t`` that are gathered over axes along
        which they vary anyway are gathered so that the gradient is a reduce-scatter.
        """
        ...

    @abc.abstractmethod
    def stored_gather(self, shape: Shape, axes: Split) -> tuple[int, tuple[str, ...]] | None:
        """``(dim, mesh axes)`` when a tensor of ``shape`` held split as ``axes``, another layout than
        the rules give it (a parameter stored split, FSDP), reaches the rules' layout by one
        all-gather along ``dim``; else None."""
        ...

    @abc.abstractmethod
    def gather_stored(
        self, arrays: list[jax.Array], gathers: Sequence[tuple[int, tuple[str, ...]] | None], *others: jax.Array
    ) -> list[jax.Array]:
        """``arrays`` with each one that has an entry in ``gathers`` gathered as it says, all those over
        the same mesh axes in one collective; ``others``: arrays the results will meet (their
        varying axes make the gradient a reduce-scatter)."""
        ...

    @abc.abstractmethod
    def finish(
        self,
        array: jax.Array,
        shape: Shape,
        axes: Split | None = None,
        pending: Sequence[str] = (),
        lazy: bool = False,
        tensor: str = "output",
    ) -> Tensor:
        """A Tensor of ``shape`` from a local ``array`` laid out as ``axes`` with ``pending`` sums.

        It is brought to the layout the rules give ``shape``. With ``lazy``, pending sums are kept
        for a later op to add, when the split dims already match.
        """
        ...

    @abc.abstractmethod
    def keep(self, array: jax.Array, shape: Shape, axes: Split) -> Tensor:
        """A Tensor of ``shape`` from a local ``array`` left laid out as ``axes`` (no relayout)."""
        ...

    def hold_whole(self, array: jax.Array, shape: Shape, names: Sequence[str]) -> jax.Array:
        """``array`` (dims ``shape``). Where XLA partitions the program (gspmd) and the layout splits
        one of the dims ``names``: constrained to hold those whole, its other dims as the layout
        says, which keeps XLA's partitioner from a partition it miscomputes (conv2d's windowed
        dims; docs/design.md, gspmd). Elsewhere ``array`` itself."""
        return array

    @abc.abstractmethod
    def with_layout(self, layout: Layout) -> Lowering:
        """This lowering under other layout rules ."""
        ...

    def attention_strategy(self, memory: str) -> str:
        """How attention runs where the keys' dim ``memory`` is split (the layout's ``[attention]``
        strategy for its axes); on global arrays nothing is split: ``all_gather``."""
        return "all_gather"

    def linear_sums(self) -> Lowering:
        """This lowering for a custom rule's tangent, whose gradient sums must be linear (here: itself)."""
        return self

    @abc.abstractmethod
    def vary_like(self, x: jax.Array, *others: jax.Array) -> jax.Array:
        """``x``, typed as varying along every mesh axis any of ``others`` varies along (for primitives
        that do not unify that themselves)."""
        ...

    @abc.abstractmethod
    def vary_operand(self, x: jax.Array, *others: jax.Array) -> jax.Array:
        """``x``, an operand that ops will meet with ``others``, made varying along their axes once,
        here, rather than by each op: its gradient is then summed over those axes here, once (in
        ``grad_reduce_dtype`` where one is set), as an op's ``prepare`` would."""
        ...

    @abc.abstractmethod
    def group_size(self, axes: Sequence[str]) -> int:
        """Number of devices along ``axes``."""
        ...

    @abc.abstractmethod
    def axis_index(self, axes: Sequence[str]) -> Any:
        """This device's position along ``axes`` (major to minor)."""
        ...

    def shard(self, size: int, axes: Sequence[str]) -> tuple[int, Any]:
        """Local length and global offset of this device's block of a dim of ``size`` split over ``axes``."""
        local = size // self.group_size(axes)
        return local, self.axis_index(axes) * local

    @abc.abstractmethod
    def reduce_max(self, x: jax.Array, positions: tuple[int, ...], axes: Sequence[str]) -> jax.Array:
        """Maximum over ``positions`` of ``x``, whose dims there are split over ``axes`` (differentiable,
        as ``jnp.max``)."""
        ...

    @abc.abstractmethod
    def pmax(self, x: Any, axes: Sequence[str]) -> Any:
        """Maximum across ``axes`` (not differentiated: for indices and stopped values); NaN when any
        device holds NaN (:func:`pmax_total`)."""
        ...

    @abc.abstractmethod
    def pmin(self, x: Any, axes: Sequence[str]) -> Any:
        """Minimum across ``axes`` (not differentiated: for indices and stopped values)."""
        ...

    @abc.abstractmethod
    def all_gather(self, x: jax.Array, axes: Sequence[str], dim: int) -> jax.Array:
        """``x``'s blocks along ``dim`` from every device along ``axes``, side by side."""
        ...

    @abc.abstractmethod
    def ppermute(
        self, x: jax.Array, axes: Sequence[str], shift: int, wrap: bool, sources: Sequence[int] | None = None
    ) -> jax.Array:
        """Send ``x`` to the device ``shift`` places further along ``axes`` (zeros arrive where none is sent).

        ``sources``: only the devices at these positions along ``axes`` send (None: all)."""
        ...

    @abc.abstractmethod
    def permute(self, x: jax.Array, axes: Sequence[str], pairs: Sequence[tuple[int, int]]) -> jax.Array:
        """``x`` sent from each device to another along ``axes``: ``pairs`` of positions ``(source,
        destination)`` along ``axes`` (major to minor); zeros arrive where none is sent."""
        ...

    @abc.abstractmethod
    def zeros_traced(self, like: Any) -> jax.Array:
        """Zeros of ``like`` (a ``jax.eval_shape`` result), typed varying along the mesh axes it varies along."""
        ...


class GlobalLowering(Lowering):
    """Global arrays, nothing split: the eager lowering. Every axes tuple is empty, collectives are
    identities and offsets zero, so the ops compute the plain global result."""

    def axes(self, shape: Shape, tensor: str = "tensor") -> Split:
        return ((),) * shape.rank

    def prepare(self, t: Tensor, axes: Split | None = None, beside: Sequence[Tensor] = ()) -> jax.Array:
        return t._data

    def stored_gather(self, shape: Shape, axes: Split) -> tuple[int, tuple[str, ...]] | None:
        return None

    def gather_stored(
        self, arrays: list[jax.Array], gathers: Sequence[tuple[int, tuple[str, ...]] | None], *others: jax.Array
    ) -> list[jax.Array]:
        return arrays

    def finish(
        self,
        array: jax.Array,
        shape: Shape,
        axes: Split | None = None,
        pending: Sequence[str] = (),
        lazy: bool = False,
        tensor: str = "output",
    ) -> Tensor:
        from meshdsl.tensor import Tensor

        return Tensor(array, shape)

    def keep(self, array: jax.Array, shape: Shape, axes: Split) -> Tensor:
        from meshdsl.tensor import Tensor

        return Tensor(array, shape)

    def with_layout(self, layout: Layout) -> Lowering:
        return self

    def vary_like(self, x: jax.Array, *others: jax.Array) -> jax.Array:
        return x

    def vary_operand(self, x: jax.Array, *others: jax.Array) -> jax.Array:
        return x

    def group_size(self, axes: Sequence[str]) -> int:
        return 1

    def axis_index(self, axes: Sequence[str]) -> Any:
        return 0

    def reduce_max(self, x: jax.Array, positions: tuple[int, ...], axes: Sequence[str]) -> jax.Array:
        return exact_max(x, 0, positions, ())

    def pmax(self, x: Any, axes: Sequence[str]) -> Any:
        return x

    def pmin(self, x: Any, axes: Sequence[str]) -> Any:
        return x

    def all_gather(self, x: jax.Array, axes: Sequence[str], dim: int) -> jax.Array:
        return x

    def ppermute(
        self, x: jax.Array, axes: Sequence[str], shift: int, wrap: bool, sources: Sequence[int] | None = None
    ) -> jax.Array:
        sends = sources is None or 0 in sources
        return x if (shift == 0 or wrap) and sends else jax.numpy.zeros_like(x)

    def permute(self, x: jax.Array, axes: Sequence[str], pairs: Sequence[tuple[int, int]]) -> jax.Array:
        return x if (0, 0) in pairs else jnp.zeros_like(x)

    def zeros_traced(self, like: Any) -> jax.Array:
        return jnp.zeros(like.shape, like.dtype)
