"""A traced program read as XLA compiles it: the one jaxpr walker of ``md.explain`` and the planner.

:func:`as_compiled` rewrites a jaxpr into the program XLA runs, so that counting collectives
(:mod:`meshdsl.explain`), buffers (:mod:`meshdsl.planner.memory`) and FLOPs
(:mod:`meshdsl.planner.flops`) all see the same program:

* Calls are inlined, as XLA inlines them: ``jit``, ``closed_call``, ``custom_jvp_call``,
  ``custom_vjp_call``, ``jax.checkpoint``'s ``remat`` and ``shard_map`` (its per-device body joins
  the program between markers of entering and leaving it, so two ``shard_map`` s of one program
  share their identical computations, as XLA's partitioned program does); ``checkpoint_name``
  and ``stop_gradient``, which emit no HLO, are dropped.
* A ``jax.checkpoint`` recomputation in a gradient (``differentiated``) whose ``prevent_cse`` is
  set (JAX's default) takes its operands through one ``optimization_barrier``, as JAX lowers it.
  A ``policy`` only changes what is saved, hence what is recomputed.
* A one-trip ``scan`` is replaced by its body, as XLA removes such a loop; other loops keep
  their bodies (:func:`trip_count` says how often a body runs).
* What a ``scan`` body computes from the loop's constants alone runs once, not once per step
  (:func:`walk`, :func:`loop_invariant`), as XLA's loop-invariant code motion moves it, collectives
  included, before the loop.
* Dead code is dropped: before inlining, as JAX does before lowering, and after (with a loop's
  carries no next iteration needs); and at the end, what merging left unused.
* Identical computations are merged within each computation (a loop body or branch is a
  computation of its own, so nothing merges across a loop's boundary), as XLA:CPU runs its CSE,
  first with the optimization barriers keeping a recomputation apart from the forward pass. What
  follows depends on the XLA at hand (:data:`CSE_AFTER_BARRIERS`): XLA of jaxlib 0.10 expands the
  barriers away (after its all-reduce combiner has tupled the all-reduces) and runs CSE again,
  merging what only a barrier kept apart except all-reduces; so a recomputed all-reduce runs
  again under ``prevent_cse=True`` and not under ``prevent_cse=False``, while a recomputed
  all-gather, reduce-scatter, all-to-all or permute merges with the forward pass's either way.
  XLA of jaxlib 0.11 and newer merges nothing a barrier kept apart: under ``prevent_cse=True``
  every recomputed collective runs again. A global array that leaves one ``shard_map`` and enters another under the same
  spec is the same per-device block: XLA cancels that round trip.
* An all-reduce or all-gather of a value computed from constants alone (a shift past the end of
  a dim, ``md.zeros``) moves nothing: the value is the same on every device, XLA's all-reduce
  simplifier turns a sum of ``n`` equal values into one times ``n`` and a max or min into the
  value, and an all-gather of a constant becomes the constant tiled.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.extend import core as jex_core
from jax.extend.core import primitives as jex_primitives

from meshdsl.errors import UnsupportedJaxError
from meshdsl.jax_compat import dce_jaxpr, jaxlib_version

_NO_OP = frozenset({"name", "stop_gradient"})
"""Primitives JAX lowers to nothing whose result has its operand's type: ``checkpoint_name``'s and
``lax.stop_gradient``'s (so ``argmax``'s local max of ``stop_gradient(x)`` merges with ``reduce_max``'s of ``x``)."""

ENTER_SHARD_MAP = jex_core.Primitive("enter_shard_map")
"""A global operand becoming a ``shard_map`` body's per-device block (``spec``, ``mesh``): no data moves."""
LEAVE_SHARD_MAP = jex_core.Primitive("leave_shard_map")
GATHERED_CONSTANT = jex_core.Primitive("gathered_constant")
"""An ``all_gather`` of a value that is the same on every device: XLA tiles it locally, no data moves."""
"""A ``shard_map`` body's per-device result becoming a global result (``spec``, ``mesh``): no data moves."""


CSE_AFTER_BARRIERS = jaxlib_version() < (0, 11)
"""Whether the XLA at hand merges, after expanding optimization barriers, what only a barrier kept
apart (all-reduces excepted): measured so with jaxlib 0.10.2; with 0.12.0.1 (and, by the same
tests failing there, 0.11.2) nothing behind a barrier merges, collective or not."""


@functools.cache
def barrier_primitive() -> Any:
    """``lax.optimization_barrier``'s primitive (``jax.extend`` does not export it)."""
    return jax.make_jaxpr(lax.optimization_barrier)(0.0).eqns[0].primitive


# ---- equation params across JAX versions ---------------------------------------------------------
# The one place that knows how each supported JAX (0.10 to 0.12) lays out the params of the
# equations meshdsl looks inside; everything else asks these functions.


def param(name: str, params: Mapping[str, Any], key: str) -> Any:
    """``params[key]`` of a ``name`` equation; UnsupportedJaxError, naming both and the JAX version, if absent."""
    if key not in params:
        raise _unsupported(name, params, f"no param {key!r}")
    return params[key]


def _unsupported(name: str, params: Mapping[str, Any], what: str) -> UnsupportedJaxError:
    return UnsupportedJaxError(
        f"meshdsl cannot read a {name!r} equation on JAX {jax.__version__}: {what} (its params: "
        f"{', '.join(sorted(params)) or 'none'}); meshdsl reads JAX 0.10 to 0.12"
    )


def scan_counts(params: Mapping[str, Any]) -> tuple[int, int]:
    """``(constants, carries)``: how many of a ``scan`` 's leading operands are loop constants and
    how many after them are carries (the rest are scanned over; its results are the carries, then
    the stacked outputs). JAX 0.10 names the counts ``num_consts`` and ``num_carry``; newer JAX
    keeps them as the sizes of the groups of a tree of its operands, ``ft_in`` (constants,
    carries, scanned-over)."""
    if "num_consts" in params and "num_carry" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    try:
        consts, carry, _ = params["ft_in"].unpack()
        return len(consts), len(carry)
    except (KeyError, AttributeError, TypeError, ValueError):
        raise _unsupported("scan", params, "no count of its constants and carries") from None


def while_counts(params: Mapping[str, Any]) -> tuple[int, int]:
    """``(condition constants, body constants)``: a ``while`` 's leading operands (its carries follow)."""
    return int(param("while", params, "cond_nconsts")), int(param("while", params, "body_nconsts"))


def loop_carries(name: str, params: Mapping[str, Any], n_operands: int) -> range:
    """Positions of a loop's operands that are its carries, in the order of its first results
    (empty for anything that is not a ``scan`` or ``while``)."""
    if name == "scan":
        consts, carry = scan_counts(params)
        return range(consts, consts + carry)
    if name == "while":
        return range(sum(while_counts(params)), n_operands)
    return range(0)


_CALLS = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
}
"""Call primitives XLA inlines, with the parameter holding the called jaxpr (operands one to one)."""
_REMATS = ("remat2", "checkpoint", "remat")
"""Names of ``jax.checkpoint``'s primitive across JAX versions."""


def called(name: str, params: Mapping[str, Any]) -> Any:
    """The jaxpr (closed or not) a call, ``jax.checkpoint`` or ``shard_map`` equation runs on its operands."""
    if name in _CALLS:
        return param(name, params, _CALLS[name])
    return param(name, params, "jaxpr")


def remat_barrier(params: Mapping[str, Any], n_operands: int) -> list[int]:
    """Operands of a ``jax.checkpoint`` equation that JAX passes through an optimization barrier: in
    a gradient (``differentiated``), those whose ``prevent_cse`` is set (one flag, or one per operand)."""
    if not params.get("differentiated", False):
        return []
    flags = params.get("prevent_cse", True)
    flags = tuple(flags) if isinstance(flags, (tuple, list)) else (flags,) * n_operands
    return [i for i, f in enumerate(flags) if f]


def shard_map_specs(params: Mapping[str, Any]) -> tuple[Any, Sequence[Any], Sequence[Any]]:
    """A ``shard_map`` 's mesh, operand specs and result specs."""
    return tuple(param("shard_map", params, k) for k in ("mesh", "in_specs", "out_specs"))


def cond_branches(params: Mapping[str, Any]) -> Sequence[Any]:
    """A ``cond`` 's branches (closed jaxprs), taking its operands after the branch index."""
    return param("cond", params, "branches")


def scan_length(params: Mapping[str, Any]) -> int:
    """How many iterations a ``scan`` runs."""
    return int(param("scan", params, "length"))


# ---- reading the rewritten program ----------------------------------------------------------


def bodies(eqn: jex_core.JaxprEqn) -> list[jex_core.Jaxpr]:
    """The jaxprs inside ``eqn``: a loop's body (and condition), a ``cond`` 's branches."""
    return [j for value in eqn.params.values() for j in _jaxprs(value)]


def trip_count(eqn: jex_core.JaxprEqn) -> int | None:
    """How often ``eqn`` 's :func:`bodies` run per run of ``eqn``: a ``scan`` 's length, None for a
    ``while`` (data-dependent), 1 for anything else (each branch of a ``cond`` counts as if taken)."""
    if eqn.primitive.name == "scan":
        return scan_length(eqn.params)
    return None if eqn.primitive.name == "while" else 1


def walk(jaxpr: jex_core.Jaxpr, times: int | None = 1) -> Iterator[tuple[jex_core.JaxprEqn, int | None]]:
    """Every equation of ``jaxpr`` at any depth, with how often it runs per run of ``jaxpr``
    (None inside a ``while`` loop). An equation of a ``scan`` body that :func:`loop_invariant` finds
    runs once per run of the loop, as XLA moves it before the loop."""
    return _walk(jaxpr, times, times, frozenset())


def _walk(
    jaxpr: jex_core.Jaxpr, times: int | None, outside: int | None, hoisted: frozenset[int]
) -> Iterator[tuple[jex_core.JaxprEqn, int | None]]:
    """:func:`walk` inside a loop body: ``outside``, how often the loop runs; ``hoisted``, the ids of
    the body's equations that run once per run of the loop."""
    for eqn in jaxpr.eqns:
        here = outside if id(eqn) in hoisted else times
        yield eqn, here
        k = trip_count(eqn)
        for body in bodies(eqn):
            inside = None if here is None or k is None else here * k
            yield from _walk(body, inside, here, loop_invariant(eqn, body))


def loop_invariant(loop: jex_core.JaxprEqn, body: jex_core.Jaxpr) -> frozenset[int]:
    """Ids of the equations of a ``scan`` 's ``body`` that XLA moves before the loop, where they run
    once: those whose results :func:`_loop_invariants_marked` found computed from the loop's
    constants alone. Empty for anything but such a ``scan``."""
    marked = loop.params.get(HOISTED, frozenset())
    found = set()
    for eqn in body.eqns:
        outs = [v for v in eqn.outvars if not isinstance(v, jex_core.DropVar)]
        if outs and all(v in marked for v in outs):
            found.add(id(eqn))
    return frozenset(found)


# ---- the rewrite -------------------------------------------------------------------------------


def as_compiled(jaxpr: jex_core.Jaxpr) -> jex_core.Jaxpr:
    """``jaxpr`` as XLA compiles it (see the module docstring); every output is kept."""
    plain: _Plain = {}
    keys: _ParamKeys = {}

    def each(j: jex_core.Jaxpr, rewrite: _Pass) -> jex_core.Jaxpr:
        return _rewritten(j, rewrite, {}, plain)

    live = _dead_dropped(jaxpr)
    inlined = _dead_dropped(each(live, _inline_eqns))
    inlined = each(inlined, _constant_collectives_dropped)
    merged = each(inlined, functools.partial(_merge_eqns, barriers=True, keys=keys))
    merged = each(merged, _loop_invariants_marked)
    merged = each(merged, functools.partial(_merge_eqns, barriers=False, merge=CSE_AFTER_BARRIERS, keys=keys))
    return each(merged, _unused_dropped)


def _dead_dropped(jaxpr: jex_core.Jaxpr) -> jex_core.Jaxpr:
    """``jaxpr`` without the equations no output needs (its inputs all kept, used or not)."""
    return dce_jaxpr(jaxpr)


def _unused_dropped(
    jaxpr: jex_core.Jaxpr, eqns: list[jex_core.JaxprEqn], subst: dict[Any, Any]
) -> list[jex_core.JaxprEqn]:
    """The equations whose results something reads, or that have an effect beyond naming mesh axes.

    Unlike :func:`_dead_dropped` it keeps every loop as it is (JAX's rule for a ``scan`` checks
    the types of its carries again, which merging values of equal buffers but different
    varying-axes types would upset).
    """
    live = {v for v in jaxpr.outvars if isinstance(v, jex_core.Var)}
    kept = []
    for eqn in reversed(eqns):
        if _effectful(eqn) or any(v in live for v in eqn.outvars if not isinstance(v, jex_core.DropVar)):
            kept.append(eqn)
            live.update(v for v in eqn.invars if isinstance(v, jex_core.Var))
    return kept[::-1]


def _effectful(eqn: jex_core.JaxprEqn) -> bool:
    """Whether ``eqn`` has an effect beyond naming mesh axes (a collective's), which keeps it apart and alive."""
    return any(type(e).__name__ != "NamedAxisEffect" for e in eqn.effects)


def _jaxprs(value: Any) -> Iterator[jex_core.Jaxpr]:
    for v in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(v, jex_core.ClosedJaxpr):
            yield v.jaxpr
        elif isinstance(v, jex_core.Jaxpr):
            yield v


_Memo = dict[int | tuple[str, int], tuple[Any, Any]]
"""Rewritten jaxprs by ``id`` of the original (``("closed", id)`` for a closed jaxpr; the original kept
alongside, so the id stays its own): a jaxpr
that several equations share stays shared, which :func:`_merge_key` relies on."""
_Pass = Callable[[jex_core.Jaxpr, list[jex_core.JaxprEqn], dict[Any, Any]], list[jex_core.JaxprEqn]]
"""One pass over a jaxpr's equations (their sub-jaxprs already rewritten), recording in the
mapping the values that later equations and the results read instead of removed ones."""
_Plain = dict[int, Any]
"""Equation params (by ``id``, the dict kept alongside so the id stays its own) known to hold no jaxpr, shared by
the passes of one :func:`as_compiled`: most equations' params are plain, and an inlined body's copies share
its equations' params, so each is searched for jaxprs once, not once per copy and pass."""


def _rewritten(jaxpr: jex_core.Jaxpr, rewrite: _Pass, memo: _Memo, plain: _Plain | None = None) -> jex_core.Jaxpr:
    """``jaxpr`` with ``rewrite`` applied to it and to every jaxpr inside it (``jaxpr`` itself if nothing changes);
    ``plain``: the params known to hold no jaxpr, shared by several passes (None: this pass's own)."""
    plain = {} if plain is None else plain
    if id(jaxpr) not in memo:
        eqns = [_params_rewritten(e, rewrite, memo, plain) for e in jaxpr.eqns]
        subst: dict[Any, Any] = {}
        eqns = rewrite(jaxpr, eqns, subst)
        outvars = [_atom(v, subst) for v in jaxpr.outvars]
        same = _same(eqns, jaxpr.eqns) and _same(outvars, jaxpr.outvars)
        memo[id(jaxpr)] = (jaxpr, jaxpr if same else jaxpr.replace(eqns=eqns, outvars=outvars))
    return memo[id(jaxpr)][1]


def _params_rewritten(eqn: jex_core.JaxprEqn, rewrite: _Pass, memo: _Memo, plain: _Plain) -> jex_core.JaxprEqn:
    if id(eqn.params) in plain:
        return eqn
    if not any(_holds_jaxpr(v) for v in eqn.params.values()):
        plain[id(eqn.params)] = eqn.params
        return eqn
    params = {k: _param_rewritten(v, rewrite, memo, plain) for k, v in eqn.params.items()}
    return eqn if _same(list(params.values()), list(eqn.params.values())) else eqn.replace(params=params)


def _holds_jaxpr(value: Any) -> bool:
    """Whether a param value is, or holds in its tuples and lists, a jaxpr (closed or not)."""
    if isinstance(value, (tuple, list)):
        return any(_holds_jaxpr(v) for v in value)
    return isinstance(value, (jex_core.ClosedJaxpr, jex_core.Jaxpr))


def _param_rewritten(value: Any, rewrite: _Pass, memo: _Memo, plain: _Plain) -> Any:
    if isinstance(value, (tuple, list)):
        items = [_param_rewritten(v, rewrite, memo, plain) for v in value]
        return value if _same(items, value) else type(value)(items)
    if isinstance(value, jex_core.ClosedJaxpr):
        inner = _rewritten(value.jaxpr, rewrite, memo, plain)
        if inner is value.jaxpr:
            return value
        key = ("closed", id(value))
        if key not in memo:
            memo[key] = (value, value.replace(jaxpr=inner))
        return memo[key][1]
    if isinstance(value, jex_core.Jaxpr):
        return _rewritten(value, rewrite, memo, plain)
    return value


def _same(new: Sequence[Any], old: Sequence[Any]) -> bool:
    """Whether ``new`` holds exactly the objects of ``old`` (identity: jaxpr variables have no value equality)."""
    return len(new) == len(old) and all(a is b for a, b in zip(new, old))


def _atom(v: Any, env: Mapping[Any, Any]) -> Any:
    """What ``v`` stands for under ``env`` (literals and unmapped variables are themselves)."""
    return env.get(v, v) if isinstance(v, jex_core.Var) else v


# ---- inlining ------------------------------------------------------------------------------------


def _inline_eqns(
    jaxpr: jex_core.Jaxpr, eqns: list[jex_core.JaxprEqn], subst: dict[Any, Any]
) -> list[jex_core.JaxprEqn]:
    """Calls, ``shard_map`` s and one-trip scans replaced by their bodies; :data:`_NO_OP` s dropped."""
    out: list[jex_core.JaxprEqn] = []
    for eqn in eqns:
        invars = [_atom(v, subst) for v in eqn.invars]
        if not _same(invars, eqn.invars):
            eqn = eqn.replace(invars=invars)
        name = eqn.primitive.name
        if name in _CALLS:
            out += _spliced(called(name, eqn.params), eqn.invars, eqn.outvars, subst)
        elif name in _REMATS:
            out += _recomputed(eqn, subst)
        elif name == "shard_map":
            out += _shard_map_inlined(eqn)
        elif name == "scan" and scan_length(eqn.params) == 1:
            out += _one_trip(eqn, subst)
        elif name in _NO_OP:
            subst[eqn.outvars[0]] = eqn.invars[0]
        else:
            out.append(eqn)
    return out


def _fresh(v: Any, env: dict[Any, Any]) -> Any:
    """A fresh variable for the binder ``v`` of an inlined body, recorded in ``env`` (drop-vars stay).

    Fresh, so that a body inlined twice does not define one variable twice.
    """
    if isinstance(v, jex_core.DropVar):
        return v
    env[v] = jex_core.Var(v.aval)
    return env[v]


def _body_eqns(body: jex_core.Jaxpr, env: dict[Any, Any]) -> list[jex_core.JaxprEqn]:
    """``body`` 's equations reading ``env`` 's values for its variables, each binder made fresh."""
    return [
        e.replace(invars=[_atom(v, env) for v in e.invars], outvars=[_fresh(v, env) for v in e.outvars])
        for e in body.eqns
    ]


def _closed_env(callee: Any) -> tuple[jex_core.Jaxpr, dict[Any, Any]]:
    """The jaxpr of ``callee`` (closed or not) and its constants as literals."""
    if isinstance(callee, jex_core.ClosedJaxpr):
        return callee.jaxpr, {v: jex_core.Literal(c, v.aval) for v, c in zip(callee.jaxpr.constvars, callee.consts)}
    return callee, {}


def _spliced(
    callee: Any, args: Sequence[Any], results: Sequence[Any], subst: dict[Any, Any]
) -> list[jex_core.JaxprEqn]:
    """The equations of ``callee`` run on ``args``; its results recorded in ``subst`` as ``results``."""
    body, env = _closed_env(callee)
    env.update(zip(body.invars, args))
    eqns = _body_eqns(body, env)
    subst.update((v, _atom(r, env)) for v, r in zip(results, body.outvars) if not isinstance(v, jex_core.DropVar))
    return eqns


def _recomputed(eqn: jex_core.JaxprEqn, subst: dict[Any, Any]) -> list[jex_core.JaxprEqn]:
    """A ``jax.checkpoint`` call inlined; in a gradient with ``prevent_cse``, behind its barrier.

    JAX lowers a differentiated checkpoint by passing the operands whose ``prevent_cse`` is set
    through one ``optimization_barrier`` before the body: XLA cannot see through it, so the
    recomputation stays apart from the forward pass.
    """
    args = list(eqn.invars)
    held = remat_barrier(eqn.params, len(args))
    barrier: list[jex_core.JaxprEqn] = []
    if held:
        outs = [jex_core.Var(args[i].aval) for i in held]
        barrier.append(
            jex_core.new_jaxpr_eqn(
                [args[i] for i in held], outs, barrier_primitive(), {}, jex_core.no_effects, eqn.source_info
            )
        )
        for i, v in zip(held, outs):
            args[i] = v
    return barrier + _spliced(called(eqn.primitive.name, eqn.params), args, eqn.outvars, subst)


def _shard_map_inlined(eqn: jex_core.JaxprEqn) -> list[jex_core.JaxprEqn]:
    """A ``shard_map`` 's body between :data:`ENTER_SHARD_MAP` and :data:`LEAVE_SHARD_MAP` markers."""
    body, env = _closed_env(called("shard_map", eqn.params))
    mesh, in_specs, out_specs = shard_map_specs(eqn.params)

    def marker(primitive: Any, source: Any, target: Any, spec: Any) -> jex_core.JaxprEqn:
        return jex_core.new_jaxpr_eqn(
            [source], [target], primitive, {"spec": spec, "mesh": mesh}, jex_core.no_effects, eqn.source_info
        )

    eqns = [marker(ENTER_SHARD_MAP, x, _fresh(v, env), spec) for x, v, spec in zip(eqn.invars, body.invars, in_specs)]
    eqns += _body_eqns(body, env)
    eqns += [
        marker(LEAVE_SHARD_MAP, _atom(r, env), v, spec) for r, v, spec in zip(body.outvars, eqn.outvars, out_specs)
    ]
    return eqns


def _reshaped(
    primitive: Any, params: dict[str, Any], source: Any, target: Any, scan: jex_core.JaxprEqn
) -> jex_core.JaxprEqn:
    """``target = primitive(source)``: the leading length-1 axis a scan adds to or takes from its slices."""
    return jex_core.new_jaxpr_eqn([source], [target], primitive, params, jex_core.no_effects, scan.source_info)


def _one_trip(scan: jex_core.JaxprEqn, subst: dict[Any, Any]) -> list[jex_core.JaxprEqn]:
    """The equations of the length-1 ``scan`` 's body, wired to its operands and results.

    Each ``xs`` operand loses its leading axis of 1 and each ``ys`` result gains it back (both
    bitcasts); the carried results are recorded in ``subst``. XLA removes a one-trip loop, after
    which the parts of its body that only the loop's dead results need are dead code: jaxpr DCE
    cannot see that inside a scan (a carry stays live when a next iteration would read it).
    """
    body, env = _closed_env(called("scan", scan.params))
    n_consts, n_carry = scan_counts(scan.params)
    n_in = n_consts + n_carry
    env.update(zip(body.invars[:n_in], scan.invars[:n_in]))
    squeeze = {"dimensions": (0,)}
    eqns = [
        _reshaped(jex_primitives.squeeze_p, squeeze, x, _fresh(v, env), scan)
        for x, v in zip(scan.invars[n_in:], body.invars[n_in:])
    ]
    eqns += _body_eqns(body, env)
    results = [_atom(v, env) for v in body.outvars]
    subst.update(
        (v, r) for v, r in zip(scan.outvars[:n_carry], results[:n_carry]) if not isinstance(v, jex_core.DropVar)
    )
    for v, y in zip(scan.outvars[n_carry:], results[n_carry:]):
        assert isinstance(v.aval, jax.core.ShapedArray)  # a scan's results are arrays
        grow = {"new_sizes": tuple(v.aval.shape), "dimensions": None, "sharding": None}
        eqns.append(_reshaped(jex_primitives.reshape_p, grow, y, v, scan))
    return eqns


# ---- loop-invariant code (XLA's WhileLoopInvariantCodeMotion) ------------------------------------


HOISTED = "meshdsl_loop_invariant"
"""The param :func:`_loop_invariants_marked` adds to a ``scan``: the values of its body computed from
the loop's constants alone (read by :func:`loop_invariant`; the program is only read, never run)."""


def _loop_invariants_marked(
    jaxpr: jex_core.Jaxpr, eqns: list[jex_core.JaxprEqn], subst: dict[Any, Any]
) -> list[jex_core.JaxprEqn]:
    """Each ``scan`` marked with the values of its body that XLA computes once, before the loop.

    A value is invariant when it is a loop constant, a carry the body passes on unchanged, or the
    result of an equation whose operands all are (literals count), with no effect beyond naming
    mesh axes and no body of its own; collectives move too (all-reduce, all-gather, reduce-scatter,
    all-to-all and permute alike, measured on JAX 0.10 and 0.12). Marked while the optimization
    barriers of a recomputation are still in place, as XLA moves code before it expands them: a
    barrier passing a loop constant beside the carry keeps what reads it inside the loop.
    """
    out = []
    for eqn in eqns:
        if eqn.primitive.name == "scan":
            (body,) = bodies(eqn)
            n_consts, n_carry = scan_counts(eqn.params)
            carries = body.invars[n_consts : n_consts + n_carry]
            fixed = set(body.invars[:n_consts]) | {v for v, o in zip(carries, body.outvars) if o is v}
            for inner in body.eqns:
                if bodies(inner) or _effectful(inner):
                    continue
                if all(isinstance(v, jex_core.Literal) or v in fixed for v in inner.invars):
                    fixed.update(inner.outvars)
            eqn = eqn.replace(params={**eqn.params, HOISTED: frozenset(fixed)})
        out.append(eqn)
    return out


# ---- all-reduces of constants (XLA's all-reduce simplifier) ------------------------------------


_PER_DEVICE = frozenset({"axis_index", "ppermute", "all_to_all", "reduce_scatter", "psum_scatter"})
"""Primitives whose result may differ between devices even when every operand is a constant."""
_ALL_GATHERS = frozenset({"all_gather", "all_gather_invariant"})


def _constant_collectives_dropped(
    jaxpr: jex_core.Jaxpr, eqns: list[jex_core.JaxprEqn], subst: dict[Any, Any]
) -> list[jex_core.JaxprEqn]:
    """Each all-reduce whose operand is computed from literals alone removed, its result recorded
    in ``subst`` as its operand (a buffer of the same type; XLA computes it locally); each
    all-gather of such an operand made a :data:`GATHERED_CONSTANT` (its result is still a buffer).

    A computation's inputs and whatever enters a ``shard_map``, a loop or a branch count as
    varying; a value is constant when every operand of the equation making it is.
    """
    constant: set[Any] = set()
    out = []
    for eqn in eqns:
        invars = [_atom(v, subst) for v in eqn.invars]
        if not _same(invars, eqn.invars):
            eqn = eqn.replace(invars=invars)
        from_constants = all(isinstance(v, jex_core.Literal) or v in constant for v in invars)
        name = eqn.primitive.name
        if from_constants and name in _ALL_REDUCES:
            subst.update(zip(eqn.outvars, invars))
            continue
        if from_constants and name in _ALL_GATHERS:
            eqn = eqn.replace(primitive=GATHERED_CONSTANT, effects=jex_core.no_effects)
        if from_constants and _same_on_every_device(eqn):
            constant.update(eqn.outvars)
        out.append(eqn)
    return out


def _same_on_every_device(eqn: jex_core.JaxprEqn) -> bool:
    """Whether ``eqn`` computes the same result on every device from equal operands: no effect,
    no device index or data exchange, no ``shard_map`` boundary, and likewise in its bodies (a
    reduction's step, a loop's body)."""
    if _effectful(eqn) or eqn.primitive.name in _PER_DEVICE or eqn.primitive in (ENTER_SHARD_MAP, LEAVE_SHARD_MAP):
        return False
    return all(_same_on_every_device(e) for body in bodies(eqn) for e in body.eqns)


# ---- merging identical computations (XLA's CSE) ----------------------------------------------------


_ALL_REDUCES = frozenset({"psum", "psum_invariant", "pmax", "pmin"})


def _merge_eqns(
    jaxpr: jex_core.Jaxpr,
    eqns: list[jex_core.JaxprEqn],
    subst: dict[Any, Any],
    barriers: bool,
    merge: bool = True,
    keys: _ParamKeys | None = None,
) -> list[jex_core.JaxprEqn]:
    """Each equation that repeats an earlier one of the same computation removed, its results
    recorded in ``subst`` as the earlier one's (XLA's CSE).

    ``barriers``: optimization barriers keep what they pass apart (XLA's CSE before it expands
    them). Otherwise they are gone, and what only they kept apart merges, all-reduces excepted
    (XLA:CPU's CSE after expanding the barriers, once its all-reduce combiner has run, merges
    every other collective but no all-reduce). ``merge`` False: the barriers are only expanded,
    nothing merges (newer XLA, :data:`CSE_AFTER_BARRIERS`). ``keys``: the params' keys found so far, shared
    by the passes of one :func:`as_compiled`.
    """
    keys = {} if keys is None else keys
    out: list[jex_core.JaxprEqn] = []
    seen: dict[tuple, int] = {}
    left: dict[Any, tuple[Any, tuple]] = {}  # a global result of a shard_map -> (its per-device value, spec and mesh)
    for eqn in eqns:
        invars = [_atom(v, subst) for v in eqn.invars]
        if not _same(invars, eqn.invars):
            eqn = eqn.replace(invars=invars)
        if eqn.primitive is barrier_primitive() and not barriers:
            subst.update(zip(eqn.outvars, eqn.invars))
            continue
        if eqn.primitive is LEAVE_SHARD_MAP:
            left[eqn.outvars[0]] = (eqn.invars[0], _marker_key(eqn))
        elif eqn.primitive is ENTER_SHARD_MAP and _left_as(left, eqn.invars[0]) == _marker_key(eqn):
            subst[eqn.outvars[0]] = left[eqn.invars[0]][0]  # the same blocks back again: XLA cancels the round trip
            continue
        key = None if not merge or (eqn.primitive.name in _ALL_REDUCES and not barriers) else _merge_key(eqn, keys)
        if key is None or key not in seen:
            if key is not None:
                seen[key] = len(out)
            out.append(eqn)
            continue
        first = seen[key]
        outvars = list(out[first].outvars)
        for i, (mine, theirs) in enumerate(zip(eqn.outvars, outvars)):
            if isinstance(mine, jex_core.DropVar):
                continue
            if isinstance(theirs, jex_core.DropVar):  # the first one's result was unused: it takes this name
                outvars[i] = mine
            else:
                subst[mine] = theirs
        if not _same(outvars, out[first].outvars):
            out[first] = out[first].replace(outvars=outvars)
    return out


def _left_as(left: Mapping[Any, tuple[Any, tuple]], operand: Any) -> tuple | None:
    """The spec and mesh under which ``operand`` left a ``shard_map``, if it did (a literal, such as
    a Python number passed to a compiled function, left none: JAX 0.12's literals are unhashable)."""
    return left[operand][1] if isinstance(operand, jex_core.Var) and operand in left else None


def _marker_key(eqn: jex_core.JaxprEqn) -> tuple:
    """The spec and mesh of a ``shard_map`` marker (a global array leaving under one spec and
    entering under the same one on the same mesh is the same per-device block)."""
    return repr(eqn.params["spec"]), repr(eqn.params["mesh"])


_ParamKeys = dict[int, tuple[Any, tuple]]
"""Equation params' keys (:func:`_merge_key`) by ``id`` of the params, the dict kept alongside so the id stays its
own: an inlined body's copies share their equations' params, so each is keyed once, not once per copy and pass."""


def _merge_key(eqn: jex_core.JaxprEqn, keys: _ParamKeys) -> tuple | None:
    """What makes ``eqn`` the same computation as an earlier one (XLA merges those), or None.

    A collective's only effect is naming mesh axes; any other effect keeps the equation apart.
    """
    if _effectful(eqn):
        return None
    known = keys.get(id(eqn.params))
    if known is None:
        known = keys[id(eqn.params)] = (eqn.params, tuple((k, _param_key(v)) for k, v in sorted(eqn.params.items())))
    return (eqn.primitive.name, known[1], tuple(_operand_key(v) for v in eqn.invars))


def _param_key(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_param_key(v) for v in value))
    if isinstance(value, (jex_core.Jaxpr, jex_core.ClosedJaxpr)):
        return ("jaxpr", id(value))
    return repr(value)


def _operand_key(v: Any) -> Any:
    if isinstance(v, jex_core.Literal):
        value = np.asarray(v.val)
        return ("literal", value.dtype, value.item() if value.ndim == 0 else id(v.val))
    return v
