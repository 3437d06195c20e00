"""A traced per-device jaxpr as a flat list of steps, for the memory and FLOP walks.

The jaxpr is first read as XLA compiles it, by the walker ``md.explain`` reads collectives with
(:func:`meshdsl.analysis.jaxpr_walk.as_compiled`: calls inlined, one-trip scans removed, dead code dropped,
identical computations merged); loops (``scan``, ``while``) and ``cond`` keep their bodies, which
run ``times`` times (or one branch of several).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from jax.extend import core as jex_core

from meshdsl.analysis.jaxpr_walk import ENTER_SHARD_MAP, LEAVE_SHARD_MAP, as_compiled, bodies, trip_count

_LOOPS = {"scan", "while", "cond"}
_ALIASES = {"pvary", "pcast", "stop_gradient", "reshape", "squeeze", "expand_dims", "transpose"}
"""Steps whose result is their input's buffer, not a new one: a type change, a bitcast, or a
transpose (XLA folds it into its neighbours: a dot's dimension numbers, a fusion, a layout)."""


def _passes_through(eqn: Any) -> bool:
    """Whether the result of ``eqn`` is its operand's buffer: a value entering or leaving a
    ``shard_map`` (each device's block)."""
    return eqn.primitive in (ENTER_SHARD_MAP, LEAVE_SHARD_MAP)


@dataclasses.dataclass
class Step:
    """One primitive: its input and output value ids with their bytes, and any loop bodies."""

    name: str
    params: dict
    ins: list[int]
    outs: list[tuple[int, int]]
    out_avals: list[Any]
    in_avals: list[Any]
    bodies: list[tuple[Block, int]]


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


def _flatten(jaxpr: Any, env: dict, ids: _Ids, steps: list[Step]) -> None:
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        ins = [ids.get(env, v) for v in eqn.invars]
        if _passes_through(eqn):
            env.update(zip(eqn.outvars, ins))
            continue
        if name in _ALIASES and len(eqn.invars) == 1 and not isinstance(eqn.invars[0], jex_core.Literal):
            env[eqn.outvars[0]] = ins[0]
            continue
        outs = []
        for v in eqn.outvars:
            env[v] = ids.new()
            outs.append((env[v], nbytes(v.aval)))
        times = trip_count(eqn) or 1  # a while loop's trip count is unknown: once
        loops = [(_block(j, ids), times) for j in bodies(eqn)] if name in _LOOPS else []
        in_avals = [v.aval for v in eqn.invars]
        steps.append(Step(name, eqn.params, ins, outs, [v.aval for v in eqn.outvars], in_avals, loops))


def _block(jaxpr: Any, ids: _Ids) -> Block:
    env = {v: ids.new() for v in jaxpr.invars}
    env.update({v: ids.new() for v in jaxpr.constvars})
    steps: list[Step] = []
    _flatten(jaxpr, env, ids, steps)
    return Block(
        steps,
        [env[v] for v in jaxpr.invars] + [env[v] for v in jaxpr.constvars],
        [ids.get(env, v) for v in jaxpr.outvars],
    )


def block(jaxpr: Any) -> Block:
    """The flat :class:`Block` of ``jaxpr`` as XLA compiles it."""
    return _block(as_compiled(jaxpr), _Ids())


def compiled_block(compiled: Any) -> Block:
    """The flat :class:`Block` of a program already read as XLA compiles it (``as_compiled``'s result). A
    ``shard_map`` is inlined there between markers that pass values through: of a step that is one ``shard_map``,
    this is the per-device program, its inputs the step's and its outputs the per-device results."""
    return _block(compiled, _Ids())
