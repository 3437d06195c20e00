"""Benchmark reports: a table on the terminal, JSON, markdown, and PNG charts."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshdsl.bench.verdict import verdict


def _fmt_bytes(b: float | None) -> str:
    if b is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(b) < 1024 or unit == "GiB":
            return f"{b:,.1f} {unit}" if unit != "B" else f"{b:,.0f} B"
        b /= 1024
    return str(b)


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _number(x: float | None, unit: float, spec: str) -> str:
    """``x / unit`` formatted by ``spec``; ``-`` where the model gives no figure (no examples_per_step,
    flops_per_step)."""
    return "-" if x is None else format(x / unit, spec)


def _bubbles(p: dict[str, Any] | None) -> str:
    """Pipelined entries: the bubble fraction in theory, of the schedule's ticks, and measured."""
    if p is None:
        return "-"
    return "/".join(
        "-" if p[k] is None else f"{p[k]:.2f}" for k in ("bubble_theoretical", "bubble_schedule", "bubble_measured")
    )


def _accelerator(s: dict[str, Any]) -> str:
    """Where an accelerator would move other bytes than this CPU run (16-bit reductions XLA's CPU widens)."""
    accel = s["predicted_bytes_per_device_on_accelerator"]
    return "" if accel == s["predicted_bytes_per_device"] else f" (accel. {_fmt_bytes(accel)})"


@dataclasses.dataclass(frozen=True)
class Column:
    """A table column: its header, its cell, what it means (the legend), and why a cell shows ``-``."""

    name: str
    cell: Callable[[dict[str, Any]], str]
    meaning: str
    dash: Callable[[dict[str, Any]], str] = lambda s: "no figure"


def _throughput(s: dict[str, Any]) -> float | None:
    return s.get("tokens_per_s", s.get("examples_per_s"))


def _explain(s: dict[str, Any]) -> str:
    return (
        _fmt_bytes(s["predicted_bytes_per_device"])
        + ("" if s["bytes_match_prediction"] else " (differs)")
        + _accelerator(s)
    )


def _no_baseline(s: dict[str, Any]) -> str:
    return s.get("baseline_note") or "no plain-JAX baseline asked for (--baseline jax)"


def _no_gspmd(s: dict[str, Any]) -> str:
    if s.get("gspmd_note") and s.get("collectives_gspmd") is None:
        return str(s["gspmd_note"])
    if s.get("collectives_gspmd") is None:
        return "not compiled on XLA's partitioner (--no-gspmd)"
    return "XLA's partitioner moves nothing where meshdsl moves bytes (no ratio)"


COLUMNS = [
    Column("model", lambda s: s["model"], "the model benchmarked"),
    Column(
        "layout", lambda s: s["layout"], "the layout (file stem or inline rules; [schedule M=n] for pipeline variants)"
    ),
    Column("mesh", lambda s: s["mesh"], "the mesh's axes and sizes"),
    Column("compile s", lambda s: f"{s['compile_s']:.1f}", "seconds to trace and compile the step (XLA)"),
    Column(
        "step ms (p25-p75)",
        lambda s: f"{s['step_s_median'] * 1e3:.1f} ({s['step_s_p25'] * 1e3:.1f}-{s['step_s_p75'] * 1e3:.1f})",
        "median step time over the rounds, in ms; in brackets the interquartile range, 25th to 75th percentile",
    ),
    Column(
        "throughput/s",
        lambda s: _number(_throughput(s), 1, ",.0f"),
        "tokens per second for models with a sequence length, else examples per second (whole mesh)",
        lambda s: "the model has no examples_per_step()",
    ),
    Column(
        "GFLOP/s",
        lambda s: _number(s["flops_per_s"], 1e9, ",.1f"),
        "the model's FLOPs per step over the median step time, in 10^9 per second (whole mesh)",
        lambda s: "the model has no flops_per_step()",
    ),
    Column(
        "MFU",
        lambda s: "n/a" if s["mfu"] is None else f"{100 * s['mfu']:.1f}%",
        "model FLOPs utilisation: GFLOP/s over the devices' peak (n/a: no known peak, e.g. a CPU)",
    ),
    Column("mem/device", lambda s: _fmt_bytes(s["memory_bytes_per_device"]["total"]), "compiled memory per device"),
    Column("collectives", lambda s: str(s["collective_count"]), "collective ops in the compiled step (HLO)"),
    Column(
        "bytes/device",
        lambda s: _fmt_bytes(s["collective_bytes_per_device"]),
        "bytes each device moves in collectives per step (compiled HLO)",
    ),
    Column(
        "explain",
        _explain,
        "bytes per device md.explain predicts from the program ((differs): not the HLO's; (accel.): on a GPU/TPU)",
    ),
    Column(
        "÷ minimum",
        lambda s: _ratio(s["bytes_over_minimum"]),
        "bytes moved over the analytic minimum for this layout (1.000: nothing wasted)",
        lambda s: "no analytic minimum for this layout (the formula has no terms for its rules)",
    ),
    Column(
        "÷ gspmd",
        lambda s: _ratio(s.get("bytes_over_gspmd")),
        "bytes moved over what XLA's own partitioner (gspmd) moves for the same step",
        _no_gspmd,
    ),
    Column(
        "÷ jax",
        lambda s: _ratio(s["overhead_vs_jax"]),
        "step time over a hand-written plain-JAX step's (--baseline jax)",
        _no_baseline,
    ),
    Column(
        "bubble theory/ticks/measured",
        lambda s: _bubbles(s.get("pipeline")),
        "pipelined layouts: idle fraction in theory, in the schedule's timetable, and fitted from the timings "
        "(measured needs 2+ microbatch counts; noisy, can be negative on a shared CPU)",
        lambda s: "not pipelined" if not s.get("pipeline") else "measured needs two or more --microbatches counts",
    ),
    Column(
        "temp/device",
        lambda s: _fmt_bytes(s["memory_bytes_per_device"]["temporaries"]),
        "compiled temporaries (activations, buffers) per device",
    ),
]


def legend(summaries: list[dict[str, Any]]) -> str:
    """What each column means, with its unit, then why each ``-`` in this table is one."""
    lines = ["legend:"] + [f"  {c.name}: {c.meaning}" for c in COLUMNS]
    dashes: dict[tuple[str, str], list[str]] = {}
    for c in COLUMNS:
        for s in summaries:
            if "-" in c.cell(s).split("/") or c.cell(s) == "-":
                dashes.setdefault((c.name, c.dash(s)), []).append(s["layout"])
    if dashes:
        lines.append("  - (no figure):")
        lines += [
            f"    {name}: {reason} ({', '.join(dict.fromkeys(layouts))})" for (name, reason), layouts in dashes.items()
        ]
    return "\n".join(lines)


def table(summaries: list[dict[str, Any]], sep: str = "  ", markdown: bool = False) -> str:
    rows = [[c.name for c in COLUMNS]] + [[c.cell(s) for c in COLUMNS] for s in summaries]
    if markdown:
        lines = ["| " + " | ".join(r) + " |" for r in rows]
        lines.insert(1, "|" + "---|" * len(COLUMNS))
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = [sep.join(c.rjust(w) if i > 2 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, sep.join("-" * w for w in widths))
    return "\n".join(lines)


def frontier(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the (memory, time) points no other point beats on both: none has less or equal
    memory and time with one of them strictly less. In order of memory."""
    return sorted(
        (
            i
            for i, (m, t) in enumerate(points)
            if not any(m2 <= m and t2 <= t and (m2, t2) != (m, t) for m2, t2 in points)
        ),
        key=lambda i: points[i],
    )


def _save(plt: Any, fig: Any, ax: Any, title: str, path: Path, legend: int | None = None) -> Path:
    """Title the chart (and give it a legend in ``legend`` point type), write it to ``path`` with nothing
    clipped (the bounding box grows to every label), close it."""
    ax.set_title(title)
    if legend:
        ax.legend(fontsize=legend, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def _rows(plt: Any, n: int) -> tuple[Any, Any]:
    """A figure for ``n`` horizontal bars, tall enough that their labels never collide (one bar per line)."""
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.32 * n))
    ax.invert_yaxis()  # the first entry on top, in the table's order
    return fig, ax


def _zero_based(ax: Any, high: float) -> None:
    """The value axis from 0 to 8% past the largest value (1 where all are 0), so no bar touches the edge."""
    ax.set_xlim(0, high * 1.08 if high > 0 else 1)


def _bars(plt: Any, summaries: list[dict[str, Any]], labels: list[str], out: Path) -> list[Path]:
    """Step time (median, whiskers from the 25th to the 75th percentile) and bytes per device, one horizontal
    bar per entry."""
    median = [s["step_s_median"] * 1e3 for s in summaries]
    low = [m - s["step_s_p25"] * 1e3 for m, s in zip(median, summaries)]
    high = [s["step_s_p75"] * 1e3 - m for m, s in zip(median, summaries)]
    moved = [s["collective_bytes_per_device"] / 2**20 for s in summaries]
    paths = []
    for name, values, errors, xlabel, top in [
        (
            "step_time.png",
            median,
            [low, high],
            "step time (ms): bar the median, whisker the interquartile range (p25-p75)",
            max(s["step_s_p75"] * 1e3 for s in summaries),
        ),
        ("bytes.png", moved, None, "collective bytes per device per step (MiB)", max(moved)),
    ]:
        fig, ax = _rows(plt, len(summaries))
        ax.barh(range(len(values)), values, xerr=errors, color="#4c72b0", capsize=3)
        ax.set_yticks(range(len(values)), labels, fontsize=8)
        ax.set_xlabel(xlabel)
        _zero_based(ax, top)
        paths.append(_save(plt, fig, ax, name.removesuffix(".png").replace("_", " "), out / name))
    return paths


def _time_against_memory(plt: Any, summaries: list[dict[str, Any]], out: Path) -> Path:
    """Step time against memory per device, one colour per model; each model's frontier (the
    layouts no other layout of it beats on both) joined and ringed. Points carry numbers (the key
    beside the plot names them), so 20 labels do not pile up on each other."""
    fig, ax = plt.subplots(figsize=(9, 5))
    number = 0
    keys = []
    for k, model in enumerate(dict.fromkeys(s["model"] for s in summaries)):
        rows = [s for s in summaries if s["model"] == model]
        points = [(s["memory_bytes_per_device"]["total"] / 2**20, s["step_s_median"] * 1e3) for s in rows]
        colour = f"C{k}"
        ax.scatter(*zip(*points), color=colour, label=model)
        best = frontier(points)
        ax.plot(*zip(*[points[i] for i in best]), color=colour, linestyle="--", linewidth=1)
        ax.scatter(*zip(*[points[i] for i in best]), facecolors="none", edgecolors=colour, s=160)
        at: dict[tuple[float, float], list[str]] = {}  # points that coincide share one label: "1,5"
        for s, point in zip(rows, points):
            number += 1
            at.setdefault(point, []).append(str(number))
            keys.append(f"{number}  {s['model']} {s['layout']}")
        for point, numbers in at.items():
            ax.annotate(",".join(numbers), point, fontsize=7, xytext=(4, 4), textcoords="offset points", color=colour)
    ax.set_xlabel("memory per device (MiB, compiled)")
    ax.set_ylabel("step time (ms, median)")
    ax.set_xlim(0, max(s["memory_bytes_per_device"]["total"] for s in summaries) / 2**20 * 1.1)
    ax.set_ylim(0, max(s["step_s_median"] for s in summaries) * 1e3 * 1.1)
    ax.text(1.02, 0.0, "\n".join(keys), transform=ax.transAxes, fontsize=7, va="bottom", family="monospace")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return _save(plt, fig, ax, "step time against memory (ringed: on the frontier)", out / "time_memory.png")


def _bytes_by_kind(plt: Any, summaries: list[dict[str, Any]], labels: list[str], out: Path) -> Path:
    """Collective bytes per device, stacked by collective kind (from the compiled HLO), one horizontal bar per entry."""
    kinds = list(dict.fromkeys(k for s in summaries for k in s["collectives_measured"]))
    fig, ax = _rows(plt, len(summaries))
    left = [0.0] * len(summaries)
    for kind in kinds:
        values = [s["collectives_measured"].get(kind, {"bytes": 0.0})["bytes"] / 2**20 for s in summaries]
        ax.barh(range(len(summaries)), values, left=left, label=kind)
        left = [b + v for b, v in zip(left, values)]
    ax.set_yticks(range(len(summaries)), labels, fontsize=8)
    ax.set_xlabel("bytes per device per step (MiB)")
    _zero_based(ax, max(left))
    return _save(plt, fig, ax, "bytes by collective kind", out / "bytes_by_kind.png", legend=8 if kinds else None)


def _bubbles_chart(plt: Any, summaries: list[dict[str, Any]], out: Path) -> list[Path]:
    """Pipelined entries: bubble fraction against microbatches, per model x layout x schedule (theory, ticks,
    measured)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for s in summaries:
        if s.get("pipeline"):
            groups.setdefault(f"{s['model']} {s['layout'].split('[')[0]} {s['pipeline']['schedule']}", []).append(s)
    if not groups:
        return []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, (name, rows) in enumerate(groups.items()):
        rows = sorted(rows, key=lambda s: s["pipeline"]["microbatches"])
        ms = [s["pipeline"]["microbatches"] for s in rows]
        for key, style in (("bubble_theoretical", "-"), ("bubble_schedule", ":"), ("bubble_measured", "--")):
            values = [s["pipeline"][key] for s in rows]
            if all(v is not None for v in values):
                ax.plot(ms, values, style, marker="o", color=f"C{k}", label=f"{name}: {key.removeprefix('bubble_')}")
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set_xlabel("microbatches (the batch grows with them: a fixed microbatch size)")
    ax.set_ylabel("bubble (fraction of the step; measured: a fit, noisy)")
    return [_save(plt, fig, ax, "pipeline bubble against microbatches", out / "bubble.png", legend=7)]


def _charts(summaries: list[dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{s['model']} {s['layout']}" for s in summaries]
    return [
        *_bars(plt, summaries, labels, out),
        _time_against_memory(plt, summaries, out),
        _bytes_by_kind(plt, summaries, labels, out),
        *_bubbles_chart(plt, summaries, out),
    ]


def notes(summaries: list[dict[str, Any]]) -> str:
    """Lines under the table: why each baseline asked for was not timed, what the gspmd column lacks, and the timing
    order's seed."""
    lines = [
        f"{s['model']} x {s['layout']}: plain-JAX baseline not timed: {s['baseline_note']}"
        for s in summaries
        if s["baseline_note"]
    ]
    lines += [f"{s['model']} x {s['layout']}: gspmd: {s['gspmd_note']}" for s in summaries if s.get("gspmd_note")]
    piped = [s for s in summaries if s.get("pipeline")]
    if piped:
        sizes = ", ".join(
            dict.fromkeys(f"M={s['pipeline']['microbatches']}: {s['examples_per_step']} examples" for s in piped)
        )
        lines.append(
            f"pipelined entries keep the microbatch size fixed, so the batch grows with the microbatch count M "
            f"({sizes}); the measured bubble is a least-squares fit across M and comes out negative when the "
            "timings are noisier than the bubble (a shared CPU): read it as a trend, not a figure"
        )
    if summaries and summaries[0].get("device_peak_bytes_in_use") is not None:
        lines.append(
            f"device memory: {_fmt_bytes(summaries[0]['device_peak_bytes_in_use'])} at most in use on the first "
            "device over the whole run (memory_stats)"
        )
    if summaries:
        lines.append(
            f"timing: {len(summaries[0]['round_orders'])} rounds, each in an order shuffled from seed "
            f"{summaries[0]['timing_seed']} (results.json: round_orders)"
        )
    return "\n".join(lines)


def write_reports(summaries: list[dict[str, Any]], out: Path, unmeasured: list[str] | None = None) -> str:
    """Write results.json, results.md and the charts into ``out``; return what the terminal shows: the
    table, its legend and notes, where the files went, and last the verdict.

    results.md opens with the verdict. ``unmeasured``: one line per entry skipped or dropped (e.g.
    ``mlp x dp: skipped, the step does not fit: ...``), listed in results.md under "Not measured"."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(summaries, indent=2))
    missing = "".join(f"\n- {line}" for line in unmeasured or [])
    missing = f"\n\nNot measured:{missing}" if missing else ""
    answer = verdict(summaries)
    key = legend(summaries)
    (out / "results.md").write_text(
        "```\n"
        + answer
        + "\n```\n\n"
        + table(summaries, markdown=True)
        + "\n\n```\n"
        + key
        + "\n```\n\n"
        + notes(summaries)
        + missing
        + "\n"
    )
    charts = _charts(summaries, out) if summaries else []
    written = ", ".join(p.name for p in [out / "results.json", out / "results.md", *charts])
    return "\n\n".join([table(summaries), key, notes(summaries), f"results in {out}/: {written}", answer])
