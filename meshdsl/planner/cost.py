"""The cost model: one model x mesh x layout priced on a device profile, without running it.

Communication is ``md.explain``'s (the traced program's own collectives and those of making its batch, priced by
:func:`meshdsl.collectives.bytes_moved`, equal to the compiled HLO's); memory is
:mod:`~meshdsl.planner.memory`'s; work is :mod:`~meshdsl.planner.flops`'. Time is

    compute = matmul FLOPs / matmul rate + fused attention FLOPs / attention rate + memory bytes / memory bandwidth
    each collective = calls x latency + bytes / bandwidth (its kind, on the link its axes span)

and the step time is their sum (no overlap assumed: meshdsl's collectives sit between the ops
that need them). A pipelined step's bubble is in its traced program (idle stages still run
their masked iterations), so it needs no term of its own.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import meshdsl as md
from meshdsl.analysis.jaxpr_walk import as_compiled
from meshdsl.collectives import Collective
from meshdsl.explain import Report, report_of_compiled
from meshdsl.model import protocol as model_protocol
from meshdsl.model.protocol import Model
from meshdsl.planner import memory as memory_model
from meshdsl.planner.flops import Work, work
from meshdsl.planner.profile import DeviceProfile
from meshdsl.planner.program import compiled_block
from meshdsl.planner.trace import Traced, trace_step

COMPUTE = "compute"
"""The compute term of :attr:`Prediction.terms`; the other terms are the collective kinds'."""


@dataclasses.dataclass(frozen=True)
class Prediction:
    """What one step of a model under a layout costs per device.

    ``terms``: the predicted step time by term, in seconds (``"compute"``, then one entry per
    collective kind): the step time is their sum, and :meth:`table` prints each. A new cost term is
    one more entry that :func:`price` adds; nothing here names the terms.
    """

    axis_sizes: Mapping[str, int]
    layout: md.Layout
    report: Report
    memory: memory_model.MemoryBreakdown
    work: Work
    terms: Mapping[str, float]

    @property
    def step_s(self) -> float:
        return sum(self.terms.values())

    @property
    def compute_s(self) -> float:
        """The compute term (matmuls, attention and memory traffic)."""
        return self.terms[COMPUTE]

    @property
    def collective_s(self) -> dict[str, float]:
        """The collectives' terms, by collective kind."""
        return {k: v for k, v in self.terms.items() if k != COMPUTE}

    @property
    def total_bytes(self) -> float:
        return self.report.total_bytes

    def bytes_by_kind(self) -> dict[str, float]:
        return {k: v["bytes"] for k, v in self.report.summary().items()}

    def table(self, compiled_memory: int | None = None) -> str:
        """The memory, work and time breakdown as aligned text (the collectives are ``str(report)``)."""
        mib = 2.0**20
        m = self.memory
        lines = [
            "memory per device (MiB)",
            f"  parameters          {m.parameters / mib:12.3f}",
            f"  optimizer state     {m.optimizer_state / mib:12.3f}",
            f"  gradients           {m.gradients / mib:12.3f}",
            f"  peak activations    {m.activations / mib:12.3f}",
            f"  total (predicted)   {m.total / mib:12.3f}",
        ]
        if compiled_memory is not None:
            lines.append(
                f"  total (compiled)    {compiled_memory / mib:12.3f}   ({m.total / compiled_memory - 1:+.1%})"
            )
        lines += [f"FLOPs per device      {self.work.flops:14.4g}", "predicted step time (ms)"]
        lines += [f"  {term:<20}{s * 1e3:12.3f}" for term, s in self.terms.items()]
        lines.append(f"  total               {self.step_s * 1e3:12.3f}")
        return "\n".join(lines)


def span(axes: tuple[str, ...], axis_sizes: Mapping[str, int]) -> int:
    """How many consecutive devices a group over ``axes`` spans (the last mesh axis varies fastest)."""
    names = list(axis_sizes)
    stride = {a: math.prod(axis_sizes[b] for b in names[i + 1 :]) for i, a in enumerate(names)}
    return max((stride[a] * axis_sizes[a] for a in axes), default=1)


def _dtype(model: Model) -> str:
    return model_protocol.compute_dtype(model)


def price(traced: Traced, model: Model, profile: DeviceProfile) -> Prediction:
    """The :class:`Prediction` of an already traced step."""
    sizes = traced.mesh.axis_sizes
    compiled = as_compiled(traced.jaxpr)  # read once: the collectives, memory and work walk the same program
    cpu = profile.platform == "cpu"
    report = report_of_compiled(as_compiled(traced.making), sizes, cpu) + report_of_compiled(compiled, sizes, cpu)
    body = compiled_block(compiled)
    mem = memory_model.breakdown(traced.state, traced.batch, traced.layout, traced.mesh, body)
    done = work(body)
    dtype = _dtype(model)
    compute = (
        done.matmul_flops / profile.matmul_rate(dtype)
        + done.attention_flops / profile.attention_rate(dtype)
        + done.memory_bytes / profile.memory_bandwidth
    )
    terms: dict[str, float] = {COMPUTE: compute}
    permutes = [r.bytes for r in report.rows if r.collective is Collective.COLLECTIVE_PERMUTE]
    # Permutes whose sources differ (a pipeline's ticks) are priced as the busiest device sends them.
    scale = report.summary()[Collective.COLLECTIVE_PERMUTE.value]["bytes"] / sum(permutes) if any(permutes) else 1.0
    for r in report.rows:
        link = profile.link(r.collective.value, span(r.axes, sizes))
        nbytes = r.bytes * scale if r.collective is Collective.COLLECTIVE_PERMUTE else r.bytes
        terms[r.collective.value] = terms.get(r.collective.value, 0.0) + link.seconds(nbytes, r.count)
    return Prediction(dict(sizes), traced.layout, report, mem, done, terms)


def predict(
    model: Model,
    optimizer: Any,
    axis_sizes: Mapping[str, int],
    layout: md.Layout,
    profile: DeviceProfile,
    grad_reduce_dtype: str | None = None,
) -> Prediction:
    """Trace one training step of ``model`` on a mesh of ``axis_sizes`` under ``layout`` and price it."""
    traced = trace_step(model, optimizer, axis_sizes, layout, grad_reduce_dtype, platform=profile.platform)
    return price(traced, model, profile)
