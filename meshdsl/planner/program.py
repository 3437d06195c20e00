"""A traced per-device jaxpr as a flat list of steps, for the memory and FLOP walks.

Calls (``jit``, ``custom_jvp_call``, ``custom_vjp_call``, ``checkpoint``, ``closed_call``) are
inlined, as XLA inlines them, and so are scans of one iteration (XLA removes such loops); other
loops (``scan``, ``while``) and ``cond`` keep their bodies, which run ``times`` times (or one
branch of several).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator

import numpy as np
from jax.extend import core as jex_core

_INLINE = {"jit", "pjit", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "checkpoint", "remat", "remat2", "closed_call", "core_call"}
_LOOPS = {"scan", "while", "cond"}
_ALIASES = {"pvary", "pcast", "stop_gradient", "reshape", "squeeze", "expand_dims", "transpose"}
"""Steps whose result is their input's buffer, not a new one: a type change, a bitcast, or a
transpose (XLA folds it into its neighbours: a dot's dimension numbers, a fusion, a layout)."""


@dataclasses.dataclass
class Step:
    """One primitive: its input and output value ids with their bytes, and any loop bodies."""

    name: str
    params: dict
    ins: list[int]
    outs: list[tuple[int, int]]
    out_avals: list[Any]
    in_avals: list[Any]
    bodies: list[tuple["Block", int]]


@dataclasses.dataclass
class Block:
    """A flat sequence of steps; ``inputs`` and ``outputs`` are the value ids it takes and gives."""

    steps: list[Step]
    inputs: list[int]
    outputs: list[int]


def nbytes(aval: Any) -> int:
    """Bytes of an abstract value (0 for tokens and keys without a shape)."""
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    try:
        itemsize = np.dtype(dtype).itemsize
    except TypeError:
        itemsize = 8  # typed PRNG keys: two uint32 words
    return math.prod(shape) * itemsize


class _Ids:
    def __init__(self) -> None:
        self.next = 0
        self.of: dict[Any, int] = {}

    def new(self) -> int:
        self.next += 1
        return self.next

    def get(self, env: dict, v: Any) -> int:
        if isinstance(v, jex_core.Literal):
            return 0
        return env[v]


def _closed(value: Any) -> Iterator[Any]:
    for v in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(v, jex_core.ClosedJaxpr):
            yield v.jaxpr
        elif isinstance(v, jex_core.Jaxpr):
            yield v


def _sub_jaxprs(eqn: Any) -> list[Any]:
    return [j for value in eqn.params.values() for j in _closed(value)]


def _times(eqn: Any) -> int:
    return int(eqn.params.get("length", 1)) if eqn.primitive.name == "scan" else 1


def _flatten(jaxpr: Any, env: dict, ids: _Ids, steps: list[Step]) -> None:
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        subs = _sub_jaxprs(eqn)
        ins = [ids.get(env, v) for v in eqn.invars]
        if (name in _INLINE or _times(eqn) == 1 and name == "scan") and len(subs) >= 1:
            inner = subs[0]
            sub_env = dict(zip(inner.invars, ins[len(ins) - len(inner.invars):]))
            _flatten(inner, sub_env, ids, steps)
            for outer, v in zip(eqn.outvars, inner.outvars):
                env[outer] = ids.get(sub_env, v)
            continue
        if name in _ALIASES and len(eqn.invars) == 1 and not isinstance(eqn.invars[0], jex_core.Literal):
            env[eqn.outvars[0]] = ins[0]
            continue
        outs = []
        for v in eqn.outvars:
            env[v] = ids.new()
            outs.append((env[v], nbytes(v.aval)))
        bodies = [(block(j, ids), _times(eqn)) for j in subs] if name in _LOOPS else []
        in_avals = [v.aval for v in eqn.invars]
        steps.append(Step(name, eqn.params, ins, outs, [v.aval for v in eqn.outvars], in_avals, bodies))


def block(jaxpr: Any, ids: _Ids | None = None) -> Block:
    """The flat :class:`Block` of ``jaxpr``."""
    ids = ids or _Ids()
    env = {v: ids.new() for v in jaxpr.invars}
    env.update({v: ids.new() for v in jaxpr.constvars})
    steps: list[Step] = []
    _flatten(jaxpr, env, ids, steps)
    return Block(steps, [env[v] for v in jaxpr.invars] + [env[v] for v in jaxpr.constvars], [ids.get(env, v) for v in jaxpr.outvars])
