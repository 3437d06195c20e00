"""``md.explain``: the communication plan of a compiled function, without running it.

It traces the spmd program to a jaxpr (no compilation, no computation) and reads every collective
in it: the forward ops', and those of any ``jax.grad`` inside the function. Each row gives the
meshdsl op that emitted it (from the ``md.<op>`` name scope every op opens), the tensor, the
collective, its mesh axes and the bytes one device moves, priced by
:func:`meshdsl.collectives.bytes_moved`. Loops count once per iteration (``scan`` multiplies by
its length); a length-1 ``scan`` and a ``jax.checkpoint`` call are replaced by their bodies, as
XLA removes a one-trip loop and inlines a call; then
dead code is dropped and repeated identical computations are counted once, as XLA drops and
merges them. The compiled program runs exactly
these collectives, which the tests check against
its HLO (:mod:`meshdsl.hlo`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.interpreters import partial_eval as pe  # dce_jaxpr: drop what XLA would drop as dead
from jax.extend import core as jex_core

from meshdsl.collectives import Collective, bytes_moved
from meshdsl.compile import Compiled
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
            raise ConfigError("md.explain: a while_loop (its trip count known only when it runs) contains collectives, whose bytes cannot be counted; loop with md.scan or lax.scan")
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


_Memo = dict[int, tuple[Any, Any]]
"""Rewritten jaxprs by ``id`` of the original (kept alongside, so the id stays its own)."""


def _same(new: Sequence[Any], old: Sequence[Any]) -> bool:
    """Whether ``new`` holds exactly the objects of ``old`` (identity: jaxpr variables have no value equality)."""
    return len(new) == len(old) and all(a is b for a, b in zip(new, old))


def _atom(v: Any, env: Mapping[Any, Any]) -> Any:
    """What ``v`` stands for under ``env`` (literals and unmapped variables are themselves)."""
    return env.get(v, v) if isinstance(v, jex_core.Var) else v


def _defined(v: Any, env: dict[Any, Any]) -> Any:
    """A fresh variable for the binder ``v`` of an inlined body, recorded in ``env`` (drop-vars stay).

    Fresh, so that a body inlined twice does not define one variable twice.
    """
    if isinstance(v, jex_core.DropVar):
        return v
    env[v] = jex_core.Var(v.aval)
    return env[v]


def _reshape(primitive: Any, params: dict[str, Any], source: Any, target: Any, scan: jex_core.JaxprEqn) -> jex_core.JaxprEqn:
    """``target = primitive(source)``: the leading length-1 axis a scan adds to or takes from its slices."""
    return jex_core.new_jaxpr_eqn([source], [target], primitive, params, jex_core.no_effects, scan.source_info)


def _call_inlined(call: jex_core.JaxprEqn, subst: dict[Any, Any]) -> list[jex_core.JaxprEqn]:
    """The equations of the rematerialised call ``call`` (``jax.checkpoint``), wired to its operands;
    its results recorded in ``subst`` for the equations after it to read instead."""
    body = call.params["jaxpr"]
    body = body.jaxpr if isinstance(body, jex_core.ClosedJaxpr) else body
    env: dict[Any, Any] = dict(zip(body.invars, call.invars))
    eqns = [e.replace(invars=[_atom(v, env) for v in e.invars], outvars=[_defined(v, env) for v in e.outvars]) for e in body.eqns]
    subst.update((v, _atom(r, env)) for v, r in zip(call.outvars, body.outvars) if not isinstance(v, jex_core.DropVar))
    return eqns


def _body_inlined(scan: jex_core.JaxprEqn, subst: dict[Any, Any]) -> list[jex_core.JaxprEqn]:
    """The equations of the length-1 ``scan``'s body, wired to its operands and results.

    Each ``xs`` operand loses its leading axis of 1 and each ``ys`` result gains it back; the
    carried results are recorded in ``subst`` for the equations after ``scan`` to read instead.
    """
    closed, n_carry = scan.params["jaxpr"], scan.params["num_carry"]
    body, n_in = closed.jaxpr, scan.params["num_consts"] + n_carry
    env: dict[Any, Any] = {v: jex_core.Literal(c, v.aval) for v, c in zip(body.constvars, closed.consts)}
    env.update(zip(body.invars[:n_in], scan.invars[:n_in]))
    eqns = [
        _reshape(lax.squeeze_p, {"dimensions": (0,)}, x, _defined(v, env), scan)
        for x, v in zip(scan.invars[n_in:], body.invars[n_in:])
    ]
    for e in body.eqns:
        invars = [_atom(v, env) for v in e.invars]
        eqns.append(e.replace(invars=invars, outvars=[_defined(v, env) for v in e.outvars]))
    results = [_atom(v, env) for v in body.outvars]
    subst.update((v, r) for v, r in zip(scan.outvars[:n_carry], results[:n_carry]) if not isinstance(v, jex_core.DropVar))
    for v, y in zip(scan.outvars[n_carry:], results[n_carry:]):
        params = {"shape": v.aval.shape, "broadcast_dimensions": tuple(range(1, v.aval.ndim)), "sharding": None}
        eqns.append(_reshape(lax.broadcast_in_dim_p, params, y, v, scan))
    return eqns


def _memoized(key: Any, make: Callable[[], Any], memo: _Memo) -> Any:
    """``make()``, once per ``key`` object: a jaxpr that equations share stays shared, so
    :func:`_cse_key` (which compares sub-jaxprs by identity) still finds them equal."""
    if id(key) not in memo:
        memo[id(key)] = (key, make())
    return memo[id(key)][1]


def _param_inlined(value: Any, memo: _Memo) -> Any:
    """An equation parameter with the jaxprs in it inlined (``value`` itself if none; see :func:`_inlined`)."""
    if isinstance(value, (tuple, list)):
        items = [_param_inlined(v, memo) for v in value]
        return value if _same(items, value) else type(value)(items)
    if isinstance(value, jex_core.ClosedJaxpr):
        inner = _inlined(value.jaxpr, memo)
        return value if inner is value.jaxpr else _memoized(value, lambda: value.replace(jaxpr=inner), memo)
    if isinstance(value, jex_core.Jaxpr):
        return _inlined(value, memo)
    return value


def _inlined(jaxpr: jex_core.Jaxpr, memo: _Memo) -> jex_core.Jaxpr:
    """``jaxpr`` with every length-1 ``scan`` and every ``jax.checkpoint`` call, at any depth,
    replaced by its body (``jaxpr`` itself if none), as XLA inlines them.

    XLA removes a one-trip loop, after which the parts of its body that only the loop's dead
    results need are dead code. Jaxpr DCE cannot see that inside a scan: it keeps a carry live
    when the next iteration would read it, and one trip has no next iteration. XLA inlines a
    rematerialised call too, and then merges a recomputed collective with the forward pass's
    identical one where both sit in one computation (outside a loop).
    """
    return _memoized(jaxpr, lambda: _eqns_inlined(jaxpr, memo), memo)


def _eqns_inlined(jaxpr: jex_core.Jaxpr, memo: _Memo) -> jex_core.Jaxpr:
    """One pass of :func:`_inlined` over ``jaxpr``'s equations, sub-jaxprs first."""
    eqns: list[jex_core.JaxprEqn] = []
    subst: dict[Any, Any] = {}
    for eqn in jaxpr.eqns:
        params = {k: _param_inlined(v, memo) for k, v in eqn.params.items()}
        invars = [_atom(v, subst) for v in eqn.invars]
        if not (_same(list(params.values()), list(eqn.params.values())) and _same(invars, eqn.invars)):
            eqn = eqn.replace(params=params, invars=invars)
        if eqn.primitive.name == "scan" and eqn.params["length"] == 1:
            eqns += _body_inlined(eqn, subst)
        elif eqn.primitive.name == "remat2":
            eqns += _call_inlined(eqn, subst)
        else:
            eqns.append(eqn)
    if _same(eqns, jaxpr.eqns):
        return jaxpr
    return jaxpr.replace(eqns=eqns, outvars=[_atom(v, subst) for v in jaxpr.outvars])


def report_of_jaxpr(jaxpr: jex_core.Jaxpr, axis_sizes: Mapping[str, int], cpu: bool) -> Report:
    """The collectives of a traced spmd program (``make_jaxpr(...).jaxpr``) on a mesh of ``axis_sizes``.

    What :func:`explain` reports, for a jaxpr already traced: the planner prices the program it
    traced itself with it. One-trip scans and checkpointed calls are inlined and dead code dropped first, as XLA does;
    ``cpu``: 16-bit float reductions count as f32, as XLA on CPU runs them.
    """
    inlined = _inlined(jaxpr, {})
    live, _ = pe.dce_jaxpr(inlined, [True] * len(inlined.outvars))
    rows: list[Communication] = []
    _walk(live, 1, axis_sizes, cpu, rows)
    return Report(_merge(rows))


def explain(
    fn: Any,
    mesh: Mesh,
    layout: Layout | str | Mapping,
    *args: Any,
    in_layouts: Sequence[Any] | None = None,
    out_layouts: Any = None,
    grad_reduce_dtype: Any = None,
    platform: str | None = None,
) -> Report:
    """The collectives ``md.compile(fn, mesh, layout, ...)`` runs on ``args``, per op, with bytes per device.

    ``platform``: price them as on that platform (default: the mesh's devices'). On ``"cpu"`` a
    16-bit float reduction counts as f32, as XLA's CPU backend runs it; on an accelerator it moves
    its own 2 bytes an element (what ``grad_reduce_dtype="bfloat16"`` saves).
    """
    program = Compiled(fn, mesh, layout, in_layouts=in_layouts, out_layouts=out_layouts, grad_reduce_dtype=grad_reduce_dtype).spmd_function
    closed = jax.make_jaxpr(program)(*args)
    return report_of_jaxpr(closed.jaxpr, mesh.axis_sizes, (platform or mesh.devices.flat[0].platform) == "cpu")
