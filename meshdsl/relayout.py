"""Relayout: move one tensor from layout A to layout B on the mesh. The one place this rule lives.

A tensor's local layout is, per dim, the ordered tuple of mesh axes that split it (major to
minor), plus the axes over which its local values are still partial sums waiting to be added
(Mesh-TF's LazyAllreduceSum). :func:`plan` turns a source and a destination layout into steps;
:func:`apply` runs them on a local shard inside ``shard_map``; :func:`step_bytes` prices them.
The lowering, ``md.explain`` and the planner all go through here.

The plan, worked on an example. Source ``(("model",), ())`` with pending sum over ``data``,
destination ``((), ("data", "model"))`` of a 2-d tensor:

1. *Pending sums.* ``data`` is the next axis dim 1 wants, so the sum is done by one
   ``psum_scatter`` over ``data`` into dim 1 (a reduce-scatter, cheaper than an all-reduce).
   Pending axes no dim wants next are added by one ``psum`` over all of them.
2. *Splits to remove.* Dim 0 must lose ``model``. It is the next axis dim 1 wants, so one
   ``all_to_all`` moves it: dim 0 is concatenated, dim 1 split. An axis no dim wants next is
   removed with ``all_gather`` (consecutive innermost such axes of a dim in one collective).
3. *Splits to add.* Whatever a dim still lacks is a local slice at the device's index: no
   communication.

Result: ``[psum_scatter(data, dim 1), all_to_all(model, dim 0 -> dim 1)]``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from meshdsl.collectives import Collective, bytes_moved

Axes = tuple[tuple[str, ...], ...]
"""Per tensor dim, the mesh axes splitting it, major to minor; ``()`` means replicated."""


class StepKind(enum.Enum):
    """What one relayout step does to the local shard."""

    PSUM = "psum"
    PSUM_SCATTER = "psum_scatter"
    ALL_GATHER = "all_gather"
    ALL_TO_ALL = "all_to_all"
    SLICE = "slice"

    @property
    def collective(self) -> Collective | None:
        return _COLLECTIVE[self]


_COLLECTIVE = {
    StepKind.PSUM: Collective.ALL_REDUCE,
    StepKind.PSUM_SCATTER: Collective.REDUCE_SCATTER,
    StepKind.ALL_GATHER: Collective.ALL_GATHER,
    StepKind.ALL_TO_ALL: Collective.ALL_TO_ALL,
    StepKind.SLICE: None,
}


@dataclasses.dataclass(frozen=True)
class Step:
    """One step: ``kind`` over mesh ``axes`` on tensor dim ``dim``.

    ``dim`` is the dim that is scattered, gathered or sliced (for ``ALL_TO_ALL`` the dim that
    gains the split; ``from_dim`` the one that loses it). ``PSUM`` has no dim.
    """

    kind: StepKind
    axes: tuple[str, ...]
    dim: int = -1
    from_dim: int = -1


@dataclasses.dataclass(frozen=True)
class State:
    """A local layout: per-dim split axes and the axes of pending partial sums."""

    axes: Axes
    pending: tuple[str, ...] = ()

    def after(self, step: Step) -> "State":
        axes = [list(a) for a in self.axes]
        pending = list(self.pending)
        if step.kind is StepKind.PSUM:
            pending = [a for a in pending if a not in step.axes]
        elif step.kind is StepKind.PSUM_SCATTER:
            pending = [a for a in pending if a not in step.axes]
            axes[step.dim].extend(step.axes)
        elif step.kind is StepKind.ALL_GATHER:
            del axes[step.dim][len(axes[step.dim]) - len(step.axes):]
        elif step.kind is StepKind.ALL_TO_ALL:
            axes[step.from_dim].pop()
            axes[step.dim].extend(step.axes)
        else:
            axes[step.dim].extend(step.axes)
        return State(tuple(map(tuple, axes)), tuple(pending))


def _common_prefix(a: Sequence[str], b: Sequence[str]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _next_wanted(cur: list[list[str]], dst: Axes, axis: str, exclude: int) -> int:
    """The dim (not ``exclude``) whose current axes are a prefix of its target and wants ``axis`` next, or -1."""
    for j, want in enumerate(dst):
        k = len(cur[j])
        if j != exclude and tuple(cur[j]) == want[:k] and len(want) > k and want[k] == axis:
            return j
    return -1


def plan(src: Axes, dst: Axes, pending: Iterable[str] = ()) -> tuple[Step, ...]:
    """Steps that turn a shard laid out as ``src`` (with ``pending`` sums) into one laid out as ``dst``."""
    if len(src) != len(dst):
        raise ValueError(f"relayout between ranks {len(src)} and {len(dst)}")
    cur = [list(a) for a in src]
    steps: list[Step] = []
    to_sum = list(pending)
    for axis in list(to_sum):
        j = _next_wanted(cur, dst, axis, exclude=-1)
        if j >= 0:
            steps.append(Step(StepKind.PSUM_SCATTER, (axis,), j))
            cur[j].append(axis)
            to_sum.remove(axis)
    if to_sum:
        steps.append(Step(StepKind.PSUM, tuple(to_sum)))

    def excess(i: int) -> int:
        return len(cur[i]) - _common_prefix(cur[i], dst[i])

    while any(excess(i) for i in range(len(cur))):
        moved = False
        for i in range(len(cur)):
            if excess(i):
                j = _next_wanted(cur, dst, cur[i][-1], exclude=i)
                if j >= 0:
                    axis = cur[i].pop()
                    steps.append(Step(StepKind.ALL_TO_ALL, (axis,), j, i))
                    cur[j].append(axis)
                    moved = True
        if moved:
            continue
        i = next(i for i in range(len(cur)) if excess(i))
        wanted = {a for want in dst for a in want}
        n = 1
        while n < excess(i) and cur[i][-n - 1] not in wanted and cur[i][-n] not in wanted:
            n += 1
        gathered = tuple(cur[i][-n:])
        del cur[i][-n:]
        steps.append(Step(StepKind.ALL_GATHER, gathered, i))
    for j, want in enumerate(dst):
        if len(want) > len(cur[j]):
            steps.append(Step(StepKind.SLICE, want[len(cur[j]):], j))
            cur[j].extend(want[len(cur[j]):])
    return tuple(steps)


def group_size(axes: Iterable[str], axis_sizes: Mapping[str, int]) -> int:
    """Devices in one group of a collective over ``axes``."""
    return math.prod(axis_sizes[a] for a in axes)


def axis_index(axes: Sequence[str], axis_sizes: Mapping[str, int]) -> jax.Array:
    """This device's position along ``axes`` taken together, major to minor."""
    index = 0
    for a in axes:
        index = index * axis_sizes[a] + lax.axis_index(a)
    return index


def local_sizes(sizes: Sequence[int], axes: Axes, axis_sizes: Mapping[str, int]) -> tuple[int, ...]:
    """Shard sizes of a tensor of global ``sizes`` laid out as ``axes``."""
    return tuple(s // group_size(a, axis_sizes) for s, a in zip(sizes, axes))


def _leading(x: jax.Array, dim: int, collective: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """``collective`` (which gathers or scatters along dim 0) run along ``dim`` of ``x``.

    Along a dim other than the first, the blocks are strided in memory: XLA then copies the shard
    and the whole result to and from a transposed layout (on the CPU, two copies of the gathered
    array per step, forward and backward). Moved to the front, the collective works on contiguous
    blocks and XLA folds the two transposes into the neighbouring dots. The collective's values
    are the same (a dot reading the result may add its products in another order).
    """
    if dim == 0:
        return collective(x)
    return jnp.moveaxis(collective(jnp.moveaxis(x, dim, 0)), 0, dim)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather_summing_grads_in(x: jax.Array, axes: tuple[str, ...], dtype: Any) -> jax.Array:
    """``all_gather`` of ``x`` along dim 0 (varying); its gradient is reduce-scattered in ``dtype``."""
    return lax.all_gather(x, axes, axis=0, tiled=True, to="varying")


def _gather_fwd(x: jax.Array, axes: tuple[str, ...], dtype: Any) -> tuple[jax.Array, None]:
    return _gather_summing_grads_in(x, axes, dtype), None


def _gather_bwd(axes: tuple[str, ...], dtype: Any, _: None, ct: jax.Array) -> tuple[jax.Array]:
    return (lax.psum_scatter(ct.astype(dtype), axes, scatter_dimension=0, tiled=True).astype(ct.dtype),)


_gather_summing_grads_in.defvjp(_gather_fwd, _gather_bwd)


def narrower(dtype: Any, grad_dtype: Any) -> bool:
    """Whether gradients of a ``dtype`` value are summed in ``grad_dtype``: a float, narrower than it."""
    return grad_dtype is not None and jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(grad_dtype).itemsize < jnp.dtype(dtype).itemsize


def _gather(x: jax.Array, axes: tuple[str, ...], to: str, grad_dtype: Any) -> jax.Array:
    """``x`` gathered along dim 0 over ``axes``. A varying result's gradient is one ``psum_scatter``,
    in ``grad_dtype`` when that is :func:`narrower` (an invariant result's gradient is a local slice)."""
    if to == "varying" and narrower(x.dtype, grad_dtype):
        return _gather_summing_grads_in(x, axes, jnp.dtype(grad_dtype))
    return lax.all_gather(x, axes, axis=0, tiled=True, to=to)


def apply(
    x: jax.Array, steps: Iterable[Step], axis_sizes: Mapping[str, int], varying: frozenset[str] = frozenset(), grad_dtype: Any = None
) -> jax.Array:
    """Run ``steps`` on the local shard ``x`` (inside ``shard_map`` over a mesh with ``axis_sizes``).

    A gather over axes in ``varying`` (axes the consuming op's result varies over anyway) yields a
    value JAX tracks as varying, whose gradient is one ``psum_scatter`` (in ``grad_dtype`` where
    that is narrower: ZeRO's gradient reduce-scatter in bf16); other gathers yield a replicated
    (invariant) value, whose gradient is a local slice of a replicated cotangent.
    """
    for step in steps:
        if step.kind is StepKind.PSUM:
            x = lax.psum(x, step.axes)
        elif step.kind is StepKind.PSUM_SCATTER:
            x = _leading(x, step.dim, lambda a: lax.psum_scatter(a, step.axes, scatter_dimension=0, tiled=True))
        elif step.kind is StepKind.ALL_GATHER:
            to = "varying" if varying.issuperset(step.axes) else "invarying"
            x = _leading(x, step.dim, lambda a: _gather(a, step.axes, to, grad_dtype))
        elif step.kind is StepKind.ALL_TO_ALL:
            x = lax.all_to_all(x, step.axes, split_axis=step.dim, concat_axis=step.from_dim, tiled=True)
        else:
            n = group_size(step.axes, axis_sizes)
            chunk = x.shape[step.dim] // n
            start = axis_index(step.axes, axis_sizes) * chunk
            x = lax.dynamic_slice_in_dim(x, start, chunk, axis=step.dim)
    return x


def gather_together(
    arrays: Sequence[jax.Array], dims: Sequence[int], axes: Axes, n: int, to: str, grad_dtype: Any = None
) -> list[jax.Array]:
    """Each of ``arrays`` gathered along its dim in ``dims`` over mesh ``axes`` (``n`` devices), by one ``all_gather``.

    The shards are flattened (gathered dim first) into one buffer, gathered once and cut apart
    again: one collective for a layer's stored parameters instead of one per parameter (PyTorch
    FSDP's flat parameter), and the same bytes. Its gradient is one ``psum_scatter`` (``to``
    "varying"; in ``grad_dtype`` where narrower) for them all. The arrays share a dtype.
    """
    moved = [jnp.moveaxis(a, d, 0) for a, d in zip(arrays, dims)]
    flat = jnp.concatenate([m.reshape(-1) for m in moved])
    rows = _gather(flat, axes, to, grad_dtype).reshape(n, -1)
    out, start = [], 0
    for m, d in zip(moved, dims):
        whole = rows[:, start : start + m.size].reshape((n * m.shape[0], *m.shape[1:]))
        out.append(jnp.moveaxis(whole, 0, d))
        start += m.size
    return out


def step_bytes(
    steps: Sequence[Step],
    start: State,
    sizes: Sequence[int],
    itemsize: int,
    axis_sizes: Mapping[str, int],
) -> list[float]:
    """Bytes each step moves per device, for a tensor of global ``sizes`` starting laid out as ``start``."""
    out = []
    state = start
    for step in steps:
        before = math.prod(local_sizes(sizes, state.axes, axis_sizes)) * itemsize
        state = state.after(step)
        after = math.prod(local_sizes(sizes, state.axes, axis_sizes)) * itemsize
        collective = step.kind.collective
        if collective is None:
            out.append(0.0)
            continue
        buffer = after if collective is Collective.ALL_GATHER else before
        out.append(bytes_moved(collective, buffer, group_size(step.axes, axis_sizes)))
    return out
