"""``md.explain``: the communication plan of a compiled function, without running it.

It traces the spmd program to a jaxpr (no compilation, no computation) and reads every collective
in it: the forward ops', and those of any ``jax.grad`` inside the function. Each row gives the
meshdsl op that emitted it (from the ``md.<op>`` name scope every op opens), the tensor, the
collective, its mesh axes and the bytes one device moves, priced by
:func:`meshdsl.collectives.bytes_moved`. Loops count once per iteration (``scan`` multiplies by
its length); dead code is dropped and repeated identical computations are counted once, as XLA
drops and merges them. The compiled program runs exactly
these collectives, which the tests check against
its HLO (:mod:`meshdsl.hlo`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.interpreters import partial_eval as pe  # dce_jaxpr: drop what XLA would drop as dead
from jax.extend import core as jex_core

from meshdsl.collectives import Collective, bytes_moved
from meshdsl.compile import Compiled
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


@dataclasses.dataclass(frozen=True)
class Report:
    """What ``md.explain`` returns: one row per op that communicates, plus totals."""

    rows: tuple[Communication, ...]

    @property
    def total_bytes(self) -> float:
        """Bytes moved per device by the whole program."""
        return sum(r.bytes for r in self.rows)

    def summary(self) -> dict[str, dict[str, float]]:
        """``{collective: {"count": ..., "bytes": ...}}``, in the form :func:`meshdsl.hlo.summary` gives."""
        out: dict[str, dict[str, float]] = {}
        for r in self.rows:
            entry = out.setdefault(r.collective.value, {"count": 0, "bytes": 0.0})
            entry["count"] += r.count
            entry["bytes"] += r.bytes
        return out

    def __str__(self) -> str:
        header = ("op", "tensor", "collective", "axes", "count", "bytes/device")
        body = [
            (r.op, r.tensor, r.collective.value, ",".join(r.axes), str(r.count), f"{r.bytes:,.0f}") for r in self.rows
        ]
        body.append(("total", "", "", "", str(sum(r.count for r in self.rows)), f"{self.total_bytes:,.0f}"))
        widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *body]]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def _sub_jaxprs(eqn: Any) -> Iterator[tuple[Any, int]]:
    """The jaxprs inside ``eqn``, each with how many times it runs per run of ``eqn``."""
    times = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, jex_core.ClosedJaxpr):
                yield v.jaxpr, times
            elif isinstance(v, jex_core.Jaxpr):
                yield v, times


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


def _cse_key(eqn: Any, alias: dict) -> tuple | None:
    """What makes ``eqn`` the same computation as an earlier one (XLA merges those), or None.

    A collective's only effect is naming mesh axes; any other effect keeps the equation apart.
    """
    if any(type(e).__name__ != "NamedAxisEffect" for e in eqn.effects):
        return None
    ins = tuple(alias.get(v, v) if isinstance(v, jex_core.Var) else ("literal", repr(v)) for v in eqn.invars)
    params = tuple(
        (k, id(v) if isinstance(v, (jex_core.Jaxpr, jex_core.ClosedJaxpr)) else repr(v)) for k, v in sorted(eqn.params.items())
    )
    return (eqn.primitive.name, params, ins)


def _walk(jaxpr: Any, times: int, axis_sizes: Mapping[str, int], cpu: bool, out: list[Communication]) -> None:
    seen: dict[tuple, Any] = {}
    alias: dict[Any, Any] = {}
    for eqn in jaxpr.eqns:
        key = _cse_key(eqn, alias)
        if key is not None and key in seen:
            alias.update(zip(eqn.outvars, seen[key].outvars))
            continue
        if key is not None:
            seen[key] = eqn
        name = eqn.primitive.name
        if name == "while" and _has_collective(eqn):
            raise ValueError("md.explain: a while_loop with a data-dependent trip count contains collectives; use lax.scan")
        collective = _PRIMITIVES.get(name)
        if collective is not None:
            axes = eqn.params.get("axes", eqn.params.get("axis_name"))
            axes = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
            n = math.prod(axis_sizes[a] for a in axes)
            if n > 1:
                side = eqn.invars if collective in (Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL) else eqn.outvars
                widen = cpu and collective in (Collective.ALL_REDUCE, Collective.REDUCE_SCATTER)
                for var in side:
                    buffer = _nbytes(var.aval, widen)
                    op, tensor = _scope(str(eqn.source_info.name_stack))
                    out.append(Communication(op, tensor, collective, axes, buffer, times, bytes_moved(collective, buffer, n) * times))
        for sub, k in _sub_jaxprs(eqn):
            _walk(sub, times * k, axis_sizes, cpu, out)


def _has_collective(eqn: Any) -> bool:
    return any(
        e.primitive.name in _PRIMITIVES or _has_collective(e) for sub, _ in _sub_jaxprs(eqn) for e in sub.eqns
    )


def _merge(rows: list[Communication]) -> tuple[Communication, ...]:
    merged: dict[tuple, Communication] = {}
    for r in rows:
        key = (r.op, r.tensor, r.collective, r.axes, r.buffer_bytes)
        if key in merged:
            m = merged[key]
            merged[key] = dataclasses.replace(m, count=m.count + r.count, bytes=m.bytes + r.bytes)
        else:
            merged[key] = r
    return tuple(merged.values())


def explain(
    fn: Any,
    mesh: Mesh,
    layout: Layout | str | Mapping,
    *args: Any,
    in_layouts: Sequence[Any] | None = None,
    out_layouts: Any = None,
    grad_reduce_dtype: Any = None,
) -> Report:
    """The collectives ``md.compile(fn, mesh, layout, ...)`` runs on ``args``, per op, with bytes per device."""
    program = Compiled(fn, mesh, layout, in_layouts=in_layouts, out_layouts=out_layouts, grad_reduce_dtype=grad_reduce_dtype).spmd_function
    closed = jax.make_jaxpr(program)(*args)
    jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
    rows: list[Communication] = []
    _walk(jaxpr, 1, mesh.axis_sizes, mesh.devices.flat[0].platform == "cpu", rows)
    return Report(_merge(rows))
