"""One way to compile a training step, read its memory and time steps side by side (bench and the planner).

A step is compiled once from a :class:`~meshdsl.train.step.Trainer` and the state it inits from a
seed; calling the result runs one step and carries the state. Timing is interleaved: every step
once per round, in an order shuffled per round from a seed (:func:`round_orders`, which bench's
report records), so slow drifts of a shared machine (and the cold caches right after a much
larger program) hit every candidate alike; the caller takes the median over rounds.
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from meshdsl.train.step import Trainer


@dataclasses.dataclass
class CompiledStep:
    """A compiled training step with its state, data key and compile time; call it to run one step."""

    trainer: Trainer
    state: Any
    data: Any
    compiled: Any
    compile_s: float

    def __call__(self) -> None:
        self.state, loss = self.compiled(self.state, self.data)
        jax.block_until_ready(loss)

    def losses(self, steps: int) -> list[float]:
        """The first ``steps`` losses from the current state, run on a copy of it."""
        return losses_from(self.state, lambda state: self.compiled(state, self.data), steps)


def losses_from(state: Any, advance: Callable[[Any], tuple[Any, Any]], steps: int) -> list[float]:
    """The losses of ``steps`` calls of ``advance`` (``state -> (state, loss)``) from a copy of
    ``state``: a step that donates its input leaves ``state`` itself untouched."""
    state = jax.tree_util.tree_map(jnp.copy, state)
    out = []
    for _ in range(steps):
        state, loss = advance(state)
        out.append(float(loss))
    return out


def compile_step(trainer: Trainer, seed: int) -> CompiledStep:
    """Init ``trainer``'s state from ``seed`` (data key: ``fold_in(seed, 1)``) and compile one step.

    Layout and config mistakes raise as the trainer raises them, before anything is timed.
    """
    key = jax.random.key(seed)
    state = trainer.init(jax.random.key_data(key))
    data = jax.random.key_data(jax.random.fold_in(key, 1))
    start = time.perf_counter()
    compiled = trainer.step.lower(state, data).compile()
    return CompiledStep(trainer, state, data, compiled, time.perf_counter() - start)


def memory_bytes(compiled: Any) -> dict[str, int]:
    """Bytes per device of a compiled program, from XLA's ``memory_analysis()``: arguments, outputs,
    temporaries, aliased (outputs sharing an argument's buffer: the donated state) and their
    total, arguments + outputs + temporaries - aliased."""
    m = compiled.memory_analysis()
    fields = {
        "arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
        "temporaries": m.temp_size_in_bytes, "aliased": m.alias_size_in_bytes,
    }
    fields["total"] = fields["arguments"] + fields["outputs"] + fields["temporaries"] - fields["aliased"]
    return {k: int(v) for k, v in fields.items()}


def round_orders(count: int, rounds: int, seed: int) -> list[list[int]]:
    """The order each of ``rounds`` rounds runs ``count`` steps in: a fresh shuffle per round,
    drawn from ``seed`` (the same seed, the same orders: a report can say which ran when)."""
    shuffle = random.Random(seed).shuffle
    orders = []
    for _ in range(rounds):
        order = list(range(count))
        shuffle(order)
        orders.append(order)
    return orders


def interleaved_rounds(steps: Sequence[Callable[[], None]], orders: Sequence[Sequence[int]], steps_per_round: int) -> list[list[float]]:
    """Seconds per step of each of ``steps``, one sample per round: after one warm-up call each,
    every round runs each step ``steps_per_round`` times, in that round's order (:func:`round_orders`)."""
    for step in steps:
        step()
    samples: list[list[float]] = [[] for _ in steps]
    for order in orders:
        for i in order:
            start = time.perf_counter()
            for _ in range(steps_per_round):
                steps[i]()
            samples[i].append((time.perf_counter() - start) / steps_per_round)
    return samples
