"""The pipeline schedules as arithmetic: which stage runs which microbatch and chunk at each tick.

Pure Python over ints (and traced ints, for :func:`forward_item` and :func:`backward_item`), no JAX
state: :mod:`meshdsl.pipeline.run` drives its tick loop with :func:`timetable`, the bench and the
planner read :func:`bubble` and :func:`ticks` from here, and the tests check the schedules'
properties (every microbatch once, no stage idle where the schedule says busy) without compiling.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


def forward_item(t: Any, s: Any, p: int, v: int) -> tuple[Any, Any, Any]:
    """``(microbatch, chunk, n)``: what stage ``s`` runs forward at tick ``t``, its ``n``-th forward.

    Microbatches go in groups of ``p``, each group through chunk 0, then chunk 1, ... (Megatron's
    interleaved order; with ``v = 1``, microbatch ``t - s``). Live where ``0 <= microbatch < M``.
    Written once for Python ints (the timetable) and traced arrays (the ticks).
    """
    n = t - s
    group, rest = n // (v * p), n % (v * p)
    return group * p + rest % p, rest // p, n


def backward_item(t: Any, s: Any, p: int, v: int) -> tuple[Any, Any, Any]:
    """``(microbatch, chunk, n)``: what stage ``s`` runs backward at tick ``t``, ``n`` the number of its forward.

    The last virtual stage runs a microbatch's backward in the tick of its forward; each virtual stage
    below one tick later (with ``v = 1``: microbatch ``t - 2(p - 1) + s``).
    """
    n = t + s - 2 * (p - 1) - (v - 1) * p
    group, rest = n // (v * p), n % (v * p)
    chunk = v - 1 - rest // p
    return group * p + rest % p, chunk, group * v * p + chunk * p + rest % p


def residual_slots(stages: int, microbatches: int, virtual_stages: int = 1) -> np.ndarray:
    """``slots[s, n]``: the ring slot where stage ``s`` keeps the residuals of its ``n``-th forward (1F1B and
    interleaved), an int array ``[p, v M]``; the ring has ``slots.max() + 1`` slots.

    A forward holds its slot from its tick to its backward's (both included: a tick writes its forward's
    residuals before its backward reads). Slots are handed out in the order of the forwards, each the
    lowest one free (greedy colouring of intervals: as many slots as a stage ever holds forwards at
    once): ``min(M, 2p - 1)`` for 1F1B, ``min(v M, (v + 1) p - 1)`` interleaved.
    """
    p, m, v = stages, microbatches, virtual_stages
    slots = np.zeros((p, v * m), np.int32)
    for s in range(p):
        backward_tick: dict[int, int] = {}
        for t in range(v * m + (v + 2) * p):
            mb, _, n = backward_item(t, s, p, v)
            if 0 <= mb < m:
                backward_tick[n] = t
        held: list[tuple[int, int]] = []  # (backward tick, slot) of the forwards held
        for n in range(v * m):
            tick = n + s  # forward_item's n-th forward of stage s
            held = [(end, slot) for end, slot in held if end >= tick]
            slots[s, n] = min(set(range(len(held) + 1)) - {slot for _, slot in held})
            held.append((backward_tick[n], int(slots[s, n])))
    return slots


@dataclasses.dataclass(frozen=True)
class Segment:
    """Consecutive ticks ``start ... start + length - 1`` in which the same stages run a forward, the same a
    backward, and the same send (``forward_sends`` to the next stage, ``backward_sends`` to the one before)."""

    start: int
    length: int
    forward: frozenset[int]
    backward: frozenset[int]
    forward_sends: frozenset[int]
    backward_sends: frozenset[int]


def timetable(schedule: str, stages: int, microbatches: int, virtual_stages: int = 1) -> list[Segment]:
    """Which stages run a forward and which a backward at each tick of ``schedule``, and which send, as segments.

    GPipe runs only the forwards (``M + p - 1`` ticks; its backward is JAX's reverse of them); 1F1B and
    interleaved also the backwards (:func:`forward_item`, :func:`backward_item`). A stage sends what
    it computed unless it is the last virtual stage (forward) or the first (backward).
    """
    p, m, v = stages, microbatches, virtual_stages
    backward = schedule != "gpipe"
    segments: list[Segment] = []
    for t in range(v * m + p - 1 + ((v + 1) * p - 2 - (p - 1) if backward else 0)):
        f = {s: forward_item(t, s, p, v) for s in range(p)}
        f = {s: c for s, (mb, c, _) in f.items() if 0 <= mb < m}
        b = {s: backward_item(t, s, p, v) for s in range(p)} if backward else {}
        b = {s: c for s, (mb, c, _) in b.items() if 0 <= mb < m}
        key = (
            frozenset(f),
            frozenset(b),
            frozenset(s for s, c in f.items() if (s, c) != (p - 1, v - 1)),
            frozenset(s for s, c in b.items() if (s, c) != (0, 0)),
        )
        last = segments[-1] if segments else None
        if last and (last.forward, last.backward, last.forward_sends, last.backward_sends) == key:
            segments[-1] = dataclasses.replace(segments[-1], length=segments[-1].length + 1)
        else:
            segments.append(Segment(t, 1, *key))
    return segments


def ticks(schedule: str, stages: int, microbatches: int, virtual_stages: int = 1) -> int:
    """Ticks of the timetable holding a forward (as many hold a backward): ``v M + p - 1``."""
    return sum(s.length for s in timetable(schedule, stages, microbatches, virtual_stages) if s.forward)


def bubble(stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """The theoretical bubble fraction: ``(p - 1) / (M + p - 1)`` (GPipe, 1F1B), ``(p - 1) / (v M + p - 1)``
    interleaved."""
    return (stages - 1) / (virtual_stages * microbatches + stages - 1)


def schedule_bubble(schedule: str, stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """The idle fraction of a stage over this module's ticks: each stage runs ``v M`` of :func:`ticks` forward ticks."""
    return 1 - virtual_stages * microbatches / ticks(schedule, stages, microbatches, virtual_stages)
