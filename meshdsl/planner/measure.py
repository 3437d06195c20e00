"""Compile and time candidates on the devices at hand, side by side, to check the predictions.

Timing is interleaved (every candidate once per round, in a shuffled order) and each
candidate's time is the median over rounds, as ``meshdsl bench`` does: slow drifts of a shared
machine hit every candidate alike.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any, Callable, Sequence

import jax
import scipy.stats

import meshdsl as md
from meshdsl.planner.search import Candidate
from meshdsl.train.step import Trainer


def compile_step(model: Any, optimizer: Any, candidate: Candidate, seed: int) -> tuple[Callable[[], None], Any]:
    """A function running one step of ``candidate`` (state carried over), and the compiled program."""
    mesh = md.Mesh(candidate.axis_sizes)
    trainer = Trainer(model, optimizer, mesh, candidate.layout)
    key = jax.random.key(seed)
    state = trainer.init(jax.random.key_data(key))
    data = jax.random.key_data(jax.random.fold_in(key, 1))
    compiled = trainer.step.lower(state, data).compile()
    holder = {"state": state}

    def step() -> None:
        holder["state"], loss = compiled(holder["state"], data)
        jax.block_until_ready(loss)

    return step, compiled


def compiled_memory(compiled: Any) -> int:
    """Bytes per device the compiled program needs: arguments + outputs + temporaries - aliased."""
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def measure(model: Any, optimizer: Any, candidates: Sequence[Candidate], rounds: int = 5, steps: int = 2, seed: int = 0) -> list[float]:
    """Median seconds per step of each candidate, timed in ``rounds`` interleaved rounds of ``steps`` steps.

    Each round visits the candidates in a fresh order (drawn from ``seed``): a step just after a
    much larger program runs with cold caches, so a fixed order would tax one candidate every round.
    """
    steps_fns = [compile_step(model, optimizer, c, seed)[0] for c in candidates]
    for fn in steps_fns:
        fn()
    shuffle = random.Random(seed).shuffle
    samples: list[list[float]] = [[] for _ in candidates]
    for _ in range(rounds):
        order = list(range(len(candidates)))
        shuffle(order)
        for i in order:
            start = time.perf_counter()
            for _ in range(steps):
                steps_fns[i]()
            samples[i].append((time.perf_counter() - start) / steps)
    return [statistics.median(s) for s in samples]


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation: the Pearson correlation of the ranks of ``a`` and ``b`` (ties
    share their mean rank); 0 when either is constant (no ranking to agree with)."""
    if len(set(a)) < 2 or len(set(b)) < 2:
        return 0.0
    return float(scipy.stats.spearmanr(a, b).statistic)


def verdict(predicted: Sequence[float], measured: Sequence[float]) -> str:
    """How well predictions ranked the measured times: Spearman, and the predicted best against the measured best.

    ``predicted`` is sorted fastest first (the search's order), so entry 0 is the chosen layout.
    """
    best = min(range(len(measured)), key=lambda i: measured[i])
    over = measured[0] / measured[best] - 1
    return (
        f"Spearman rank correlation, predicted vs measured: {spearman(predicted, measured):.3f} over {len(measured)} layouts; "
        f"the chosen layout (#1) measured {measured[0] * 1e3:.2f} ms, {over:+.1%} against the fastest measured "
        f"(#{best + 1}, {measured[best] * 1e3:.2f} ms)"
    )
