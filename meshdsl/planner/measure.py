"""Compile and time candidates on the devices at hand, side by side, to check the predictions.

Compiling and timing are ``meshdsl bench``'s own (:mod:`meshdsl.measure.timing`): interleaved
rounds, the candidates in a shuffled order each round, each candidate's time the median over
rounds, so slow drifts of a shared machine hit every candidate alike.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import meshdsl as md
from meshdsl.measure.timing import compile_step, interleaved_rounds, round_orders
from meshdsl.model.protocol import Model
from meshdsl.planner.search import Candidate
from meshdsl.train.step import Trainer


def measure(
    model: Model, optimizer: Any, candidates: Sequence[Candidate], rounds: int = 5, steps: int = 2, seed: int = 0
) -> list[float]:
    """Median seconds per step of each candidate, timed in ``rounds`` interleaved rounds of ``steps``
    steps, the candidates in a fresh shuffled order each round (:func:`meshdsl.measure.timing.interleaved_rounds`)."""
    trainers = [(Trainer(model, optimizer, md.Mesh(c.axis_sizes), c.layout), c.name) for c in candidates]
    compiled = [
        compile_step(trainer, seed, what=f"candidate {name}") for trainer, name in trainers
    ]  # each checked to fit first
    return [
        statistics.median(s) for s in interleaved_rounds(compiled, round_orders(len(compiled), rounds, seed), steps)
    ]


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation: the Pearson correlation of the ranks of ``a`` and ``b`` (ties
    share their mean rank); 0 when either is constant (no ranking to agree with)."""
    # Imported here: it takes 1.5 s to import, which a search without --measure (every worker too) need not pay.
    import scipy.stats

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
        f"Spearman rank correlation, predicted vs measured: {spearman(predicted, measured):.3f} over {len(measured)} "
        "layouts; "
        f"the chosen layout (#1) measured {measured[0] * 1e3:.2f} ms, {over:+.1%} against the fastest measured "
        f"(#{best + 1}, {measured[best] * 1e3:.2f} ms)"
    )
