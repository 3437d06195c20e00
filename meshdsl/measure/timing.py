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
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

import meshdsl as md
from meshdsl.measure import fits
from meshdsl.tensor import is_tensor

if TYPE_CHECKING:  # a type only: train imports this module (to check its step fits)
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


def abstract_state(trainer: Trainer) -> Any:
    """The state's shapes, dtypes and shardings as ``trainer.init`` makes it (md tensors split by
    the stored rules, the rest replicated): a step compiles for it without allocating anything."""
    mesh, stored = trainer.mesh.jax_mesh, trainer.layout.param_layout

    def shaped(x: Any) -> Any:
        if isinstance(x, md.Tensor):
            sharding = NamedSharding(mesh, stored.spec(x.shape))
            return md.Tensor(jax.ShapeDtypeStruct(x.array.shape, x.array.dtype, sharding=sharding), x.shape)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, PartitionSpec()))

    return jax.tree_util.tree_map(shaped, trainer.abstract_state(), is_leaf=is_tensor)


def abstract_like(tree: Any) -> Any:
    """``tree``'s arrays (in md tensors too) as ``jax.ShapeDtypeStruct``, with their shardings where
    committed to devices (an uncommitted array, like a fresh data key, goes where the step puts it)."""

    def shaped(a: Any) -> Any:
        sharding = a.sharding if getattr(a, "committed", False) else None
        return a if isinstance(a, jax.ShapeDtypeStruct) else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)

    return jax.tree_util.tree_map(shaped, tree)


def compile_checked(trainer: Trainer, data: Any, what: str, capacity: fits.Capacity | None = None) -> Any:
    """``trainer``'s step compiled for its state's shapes (nothing allocated) and ``data`` (a data
    key or a batch; concrete or abstract), checked against the device's memory first:
    :class:`meshdsl.measure.fits.DoesNotFit` (naming ``what``) when it needs more than a device has."""
    compiled = compile_abstract(trainer, data)
    fits.check(what, memory_bytes(compiled), capacity, remat=fits.remats(trainer.model))
    return compiled


def compile_abstract(trainer: Trainer, data: Any) -> Any:
    """``trainer``'s step compiled for its state's shapes and ``data``'s, nothing allocated (not checked)."""
    return trainer.step.lower(abstract_state(trainer), abstract_like(data)).compile()


def compile_step(
    trainer: Trainer, seed: int, what: str = "the step", capacity: fits.Capacity | None = None
) -> CompiledStep:
    """Compile one step of ``trainer``, check that it fits the device (:mod:`meshdsl.measure.fits`),
    then init its state from ``seed`` (data key: ``fold_in(seed, 1)``).

    Layout and config mistakes raise as the trainer raises them, and a step that does not fit
    raises :class:`~meshdsl.measure.fits.DoesNotFit`, before any state is allocated or anything timed.
    """
    key = jax.random.key(seed)
    data = jax.random.key_data(jax.random.fold_in(key, 1))
    start = time.perf_counter()
    compiled = compile_checked(trainer, data, what, capacity)
    compile_s = time.perf_counter() - start
    state = trainer.init(jax.random.key_data(key))
    return CompiledStep(trainer, state, data, compiled, compile_s)


def memory_bytes(compiled: Any) -> dict[str, int]:
    """Bytes per device of a compiled program, from XLA's ``memory_analysis()``: arguments, outputs,
    temporaries, aliased (outputs sharing an argument's buffer: the donated state) and their
    total, arguments + outputs + temporaries - aliased."""
    m = compiled.memory_analysis()
    fields = {
        "arguments": m.argument_size_in_bytes,
        "outputs": m.output_size_in_bytes,
        "temporaries": m.temp_size_in_bytes,
        "aliased": m.alias_size_in_bytes,
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


def interleaved_rounds(
    steps: Sequence[Callable[[], None]],
    orders: Sequence[Sequence[int]],
    steps_per_round: int,
    failed: dict[int, BaseException] | None = None,
    on_round: Callable[[int], None] | None = None,
) -> list[list[float]]:
    """Seconds per step of each of ``steps``, one sample per round: after one warm-up call each,
    every round runs each step ``steps_per_round`` times, in that round's order (:func:`round_orders`).

    With ``failed`` (a dict to fill), a step that runs out of device memory at run time
    (:func:`meshdsl.measure.fits.is_out_of_memory`) is recorded there by index and left out of the
    later rounds, so the other steps' samples are kept; without it, the error propagates.
    ``on_round(r)`` is called after the warm-up (``r = 0``) and after each round ``r`` (progress lines)."""

    def run(i: int) -> bool:
        try:
            steps[i]()
            return True
        except Exception as e:  # XLA raises its runtime errors as one class; keep only out-of-memory
            if failed is None or not fits.is_out_of_memory(e):
                raise
            failed[i] = e
            return False

    for i in range(len(steps)):
        run(i)
    if on_round is not None:
        on_round(0)
    samples: list[list[float]] = [[] for _ in steps]
    for r, order in enumerate(orders, 1):
        for i in order:
            if failed and i in failed:
                continue
            start = time.perf_counter()
            if all(run(i) for _ in range(steps_per_round)):
                samples[i].append((time.perf_counter() - start) / steps_per_round)
        if on_round is not None:
            on_round(r)
    return samples
