"""``md.explain``: the communication plan of a compiled function, without running it.

It traces the spmd program to a jaxpr (no compilation, no computation) and reads every collective
in it: the forward ops', and those of any ``jax.grad`` inside the function. Each row gives the
meshdsl op that emitted it (from the ``md.<op>`` name scope every op opens), the tensor, the
collective, its mesh axes, the bytes one device moves, priced by
:func:`meshdsl.collectives.bytes_moved`, and the line of the user's code that called the op
(:mod:`meshdsl.analysis.user_lines`). The program is read as XLA compiles it
(:mod:`meshdsl.analysis.jaxpr_walk`: calls inlined, one-trip loops removed, dead code dropped, identical
computations merged; a ``jax.checkpoint`` recomputation repeats its all-reduces behind its
optimization barrier unless ``prevent_cse=False``), and a loop's collectives count once per
iteration. The compiled program runs exactly these collectives, which the tests check against
its HLO (:mod:`meshdsl.analysis.hlo`).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from meshdsl.analysis import hlo
from meshdsl.analysis.jaxpr_walk import as_compiled, walk
from meshdsl.analysis.user_lines import ranked_line
from meshdsl.collectives import Collective, busiest_device, bytes_moved, priced_buffer
from meshdsl.compile import Backend, Compiled
from meshdsl.errors import ConfigError
from meshdsl.layout import Layout
from meshdsl.mesh import Mesh

_PRIMITIVES = {
    "psum": Collective.ALL_REDUCE,
    "psum_invariant": Collective.ALL_REDUCE,
    "pmax": Collective.ALL_REDUCE,
    "pmin": Collective.ALL_REDUCE,
    "all_gather": Collective.ALL_GATHER,
    "all_gather_invariant": Collective.ALL_GATHER,
    "reduce_scatter": Collective.REDUCE_SCATTER,
    "all_to_all": Collective.ALL_TO_ALL,
    "ppermute": Collective.COLLECTIVE_PERMUTE,
}


@dataclasses.dataclass(frozen=True)
class Communication:
    """One collective in the program (``count`` times, ``bytes`` per device over all of them)."""

    op: str
    tensor: str
    collective: Collective
    axes: tuple[str, ...]
    buffer_bytes: int
    count: int
    bytes: float
    source: str = ""
    """``FILE:LINE`` of the user's code that called the op (:func:`meshdsl.analysis.user_lines.user_line`);
    "" when no frame of it is known (a collective XLA's partitioner inserted)."""
    senders: frozenset[int] | None = None
    """The devices that send (row-major over the mesh's axes): a permute's sources; None: every device."""


class Source(enum.Enum):
    """Where a :class:`Report`'s collectives come from."""

    TRACED = "traced"
    """meshdsl's spmd program, read from its trace before anything compiles (a prediction that
    equals its compiled HLO)."""
    COMPILED = "compiled"
    """XLA's choice, measured: read from the compiled HLO of the gspmd program."""


@dataclasses.dataclass(frozen=True)
class Report:
    """What ``md.explain`` returns: one row per op that communicates, plus totals."""

    rows: tuple[Communication, ...]
    source: Source = Source.TRACED

    @property
    def total_bytes(self) -> float:
        """Bytes moved by the device that moves the most over the whole program (a permute counts on its
        sources only: :func:`meshdsl.collectives.busiest_device`)."""
        return busiest_device((r.bytes, r.senders) for r in self.rows)

    def __add__(self, other: Report) -> Report:
        """The collectives of both programs, run one after the other (rows of the same op merged)."""
        return Report(_merge([*self.rows, *other.rows]), self.source)

    def summary(self) -> dict[str, dict[str, float]]:
        """``{collective: {"count": ..., "bytes": ...}}``, in the form :func:`meshdsl.analysis.hlo.summary` gives: runs,
        and the bytes the busiest device sends."""
        out: dict[str, dict[str, float]] = {}
        for kind in dict.fromkeys(r.collective for r in self.rows):
            mine = [r for r in self.rows if r.collective is kind]
            out[kind.value] = {
                "count": sum(r.count for r in mine),
                "bytes": busiest_device((r.bytes, r.senders) for r in mine),
            }
        return out

    def __str__(self) -> str:
        lines_known = any(r.source for r in self.rows)
        header: tuple[str, ...] = ("op", "tensor", "collective", "axes", "count", "bytes/device")
        header += ("source",) if lines_known else ()
        body: list[tuple[str, ...]] = [
            (r.op, r.tensor, r.collective.value, ",".join(r.axes), str(r.count), f"{r.bytes:,.0f}")
            + ((r.source,) if lines_known else ())
            for r in self.rows
        ]
        body.append(("total", "", "", "", str(sum(r.count for r in self.rows)), f"{self.total_bytes:,.0f}", ""))
        widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *body]]
        lines.insert(1, "  ".join("-" * w for w in widths))
        if self.source is Source.COMPILED:
            lines.insert(0, "measured: the collectives XLA's partitioner chose, read from the compiled gspmd program")
        return "\n".join(lines)


def _scope(name_stack: str) -> tuple[str, str]:
    ops = re.findall(r"md\.(\w+)", name_stack)
    tensors = re.findall(r"(\[[^\]/]*\])", name_stack)
    op = ops[-1] if ops else "(outside ops)"
    if "transpose(" in name_stack:
        op += " (grad)"
    return op, tensors[-1] if tensors else ""


def _nbytes(aval: Any, widen: bool) -> int:
    """Bytes of ``aval``; ``widen``: a 16-bit float counts as f32, as XLA on CPU reduces it in f32."""
    itemsize = np.dtype(aval.dtype).itemsize
    if widen and itemsize == 2 and jnp.issubdtype(aval.dtype, jnp.floating):
        itemsize = 4
    return math.prod(aval.shape) * itemsize


def _communications(
    eqn: Any, times: int | None, axis_sizes: Mapping[str, int], cpu: bool, source: str = ""
) -> list[Communication]:
    """The rows of ``eqn`` if it is a collective over more than one device (``times`` runs of it),
    credited to ``source`` (:func:`_source`)."""
    collective = _PRIMITIVES.get(eqn.primitive.name)
    if collective is None:
        return []
    axes = eqn.params.get("axes", eqn.params.get("axis_name"))
    axes = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
    n = math.prod(axis_sizes[a] for a in axes)
    if n == 1:
        return []
    op, tensor = _scope(str(eqn.source_info.name_stack))
    if times is None:
        raise ConfigError(
            f"md.explain: {eqn.primitive.name} over {','.join(axes)} in op {op} runs inside a while_loop, whose "
            "trip count depends on data, so its bytes cannot be counted; use md.scan or lax.scan",
            op="explain",
        )
    widen = cpu and collective in (Collective.ALL_REDUCE, Collective.REDUCE_SCATTER)
    senders = _senders(eqn.params["perm"], axes, axis_sizes) if collective is Collective.COLLECTIVE_PERMUTE else None
    rows = []
    for a, b in zip(eqn.invars, eqn.outvars, strict=True):
        given, got = _nbytes(a.aval, widen), _nbytes(b.aval, widen)
        buffer = int(priced_buffer(collective, given, got, n))
        moved = float(bytes_moved(collective, given, got, n) * times)
        rows.append(Communication(op, tensor, collective, axes, buffer, times, moved, source, senders=senders))
    return rows


def _senders(perm: Sequence[tuple[int, int]], axes: tuple[str, ...], axis_sizes: Mapping[str, int]) -> frozenset[int]:
    """The devices (row-major over ``axis_sizes``) that send in a ``ppermute`` over ``axes`` with pairs ``perm``
    (positions along ``axes``, major to minor, as ``lax.ppermute`` numbers them)."""
    names = list(axis_sizes)
    coords = np.indices(tuple(axis_sizes.values())).reshape(len(names), -1)
    position = np.zeros(coords.shape[1], dtype=int)
    for a in axes:
        position = position * axis_sizes[a] + coords[names.index(a)]
    return frozenset(int(d) for d in np.flatnonzero(np.isin(position, [i for i, _ in perm])))


def _merge(rows: list[Communication]) -> tuple[Communication, ...]:
    merged: dict[tuple, Communication] = {}
    for r in rows:
        key = (r.op, r.tensor, r.collective, r.axes, r.buffer_bytes, r.source, r.senders)
        if key in merged:
            m = merged[key]
            merged[key] = dataclasses.replace(m, count=m.count + r.count, bytes=m.bytes + r.bytes)
        else:
            merged[key] = r
    return tuple(merged.values())


def report_of_jaxpr(jaxpr: jex_core.Jaxpr, axis_sizes: Mapping[str, int], cpu: bool) -> Report:
    """The collectives of a traced program (``make_jaxpr(...).jaxpr``) on a mesh of ``axis_sizes``.

    What :func:`explain` reports, for a jaxpr already traced: the planner prices the program it
    traced itself with it. The program is read as XLA compiles it (:func:`meshdsl.analysis.jaxpr_walk.as_compiled`);
    ``cpu``: 16-bit float reductions count as f32, as XLA on CPU runs them. ConfigError for a
    collective inside a ``while_loop`` (its trip count is unknown).
    """
    return report_of_compiled(as_compiled(jaxpr), axis_sizes, cpu)


def report_of_compiled(compiled: jex_core.Jaxpr, axis_sizes: Mapping[str, int], cpu: bool) -> Report:
    """:func:`report_of_jaxpr` of a program already read as XLA compiles it (``as_compiled``'s result: the
    planner reads one program for its collectives, memory and work)."""
    walked = list(walk(compiled))
    made_by = {v: eqn for eqn, _ in walked for v in eqn.outvars}
    rows = [
        r
        for eqn, times in walked
        if eqn.primitive.name in _PRIMITIVES
        for r in _communications(eqn, times, axis_sizes, cpu, _source(eqn, made_by))
    ]
    return Report(_merge(rows))


_FOLLOWED = 64
"""How many equations back :func:`_source` looks for the user's line of a result's pending sum."""


def _source(eqn: Any, made_by: Mapping[Any, Any]) -> str:
    """The user's line a collective comes from (:func:`meshdsl.analysis.user_lines.ranked_line`).

    A partial sum is added where its value is needed; one still pending when the compiled
    function returns is added there (op ``result``), in meshdsl's code: it comes from the user's op
    that left it pending (``md.reduce_sum`` over a split dim), found by following the collective's
    operand back to the nearest equation the user's code traced.
    """
    rank, line = ranked_line(eqn.source_info)
    if rank == 0 or _scope(str(eqn.source_info.name_stack))[0] != "result":
        return line
    seen, todo = 0, [v for v in eqn.invars if isinstance(v, jex_core.Var) and v in made_by]
    while todo and seen < _FOLLOWED:
        maker = made_by[todo.pop(0)]
        seen += 1
        maker_rank, maker_line = ranked_line(maker.source_info)
        if maker_rank == 0:
            return maker_line
        todo += [v for v in maker.invars if isinstance(v, jex_core.Var) and v in made_by]
    return line


def report_of_hlo(hlo_text: str, mesh: Mesh) -> Report:
    """The collectives of a program compiled for ``mesh`` (``compiled.as_text()``), as a measured :class:`Report`.

    Each collective's op and tensor come from the name stack in its metadata (XLA's partitioner
    labels what it inserts with the op whose sharding needed it); its axes are the mesh axes its
    replica group (a permute's pairs) spans, partition ids indexing the mesh's devices row-major.
    """
    names = list(mesh.axis_sizes)
    shape = tuple(mesh.axis_sizes.values())

    def axes(c: hlo.HloCollective) -> tuple[str, ...]:
        pairs = c.pairs or tuple((c.group[0], i) for i in c.group[1:])
        varying = {
            names[k]
            for a, b in pairs
            for k, (i, j) in enumerate(zip(np.unravel_index(a, shape), np.unravel_index(b, shape)))
            if i != j
        }
        return tuple(n for n in names if n in varying)

    rows = []
    for c in hlo.collectives(hlo_text, num_devices=mesh.size):
        op, tensor = _scope(c.op_name)
        rows.append(
            Communication(
                op, tensor, c.collective, axes(c), c.buffer_bytes, c.count, c.bytes_per_device, senders=c.senders
            )
        )
    return Report(_merge(rows), Source.COMPILED)


PLATFORMS = ("cpu", "gpu", "cuda", "rocm", "tpu")
"""The platforms ``explain`` prices for (JAX's names for its devices' platforms)."""


def explain(
    fn: Any = None,
    mesh: Mesh | None = None,
    layout: Layout | str | Mapping | None = None,
    *args: Any,
    in_layouts: Sequence[Any] | None = None,
    out_layouts: Any = None,
    grad_reduce_dtype: Any = None,
    platform: str | None = None,
    backend: Backend | str = Backend.SPMD,
) -> Report:
    """The collectives ``md.compile(fn, mesh, layout, backend, ...)`` runs on ``args``, per op, with bytes per device.

    ``backend="spmd"`` (default): meshdsl's own plan, read from the trace without compiling.
    ``platform``: price it as on that platform (default: the mesh's devices'). On ``"cpu"`` a
    16-bit float reduction counts as f32, as XLA's CPU backend runs it; on an accelerator it moves
    its own 2 bytes an element (what ``grad_reduce_dtype="bfloat16"`` saves).

    ``backend="gspmd"``: XLA's partitioner chooses the collectives, so they are known only once it
    has: the program is compiled for the devices at hand and its HLO read
    (:func:`report_of_hlo`; ``Report.source`` is ``Source.COMPILED``). ``platform`` must then be
    the devices' own (or None).
    """
    if fn is None or mesh is None:
        missing = [name for name, value in (("fn", fn), ("mesh", mesh)) if value is None]
        raise ConfigError(
            f"md.explain: no {' and no '.join(missing)} given; call md.explain(fn, mesh, layout, *args)", op="explain"
        )
    if platform is not None and platform not in PLATFORMS:
        raise ConfigError(
            f"md.explain: platform {platform!r} is not one of {', '.join(PLATFORMS)} (None: the mesh's devices')",
            op="explain",
        )
    compiled = Compiled(
        fn, mesh, layout, backend, in_layouts=in_layouts, out_layouts=out_layouts, grad_reduce_dtype=grad_reduce_dtype
    )
    if compiled.backend is Backend.GSPMD:
        if isinstance(mesh.jax_mesh, jax.sharding.AbstractMesh):
            raise ConfigError(
                f"md.explain: backend gspmd compiles for real devices, but mesh {mesh} is abstract; build it on "
                f"devices (md.Mesh({mesh}))",
                op="explain",
            )
        here = mesh.devices.flat[0].platform
        if platform not in (None, here):
            raise ConfigError(
                f"md.explain: backend gspmd is measured on the devices at hand ({here}); it cannot be priced as on "
                f"{platform}",
                op="explain",
            )
        text = compiled.lower(*args).compile().as_text()
        if text is None:
            raise ConfigError(
                f"md.explain: backend gspmd reads the compiled program's HLO, which {here} does not give", op="explain"
            )
        return report_of_hlo(text, mesh)
    closed = jax.make_jaxpr(compiled.spmd_function)(*args)
    return report_of_jaxpr(closed.jaxpr, mesh.axis_sizes, (platform or mesh.devices.flat[0].platform) == "cpu")
