"""Benchmark reports: a table on the terminal, JSON, markdown, and PNG charts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


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


COLUMNS = [
    ("model", lambda s: s["model"]),
    ("layout", lambda s: s["layout"]),
    ("mesh", lambda s: s["mesh"]),
    ("compile s", lambda s: f"{s['compile_s']:.1f}"),
    ("step ms", lambda s: f"{s['step_s_median'] * 1e3:.1f} ± {s['step_s_spread'] * 1e3:.1f}"),
    ("throughput/s", lambda s: _number(s.get("tokens_per_s", s.get("examples_per_s")), 1, ",.0f")),
    ("GFLOP/s", lambda s: _number(s["flops_per_s"], 1e9, ",.1f")),
    ("MFU", lambda s: "n/a" if s["mfu"] is None else f"{100 * s['mfu']:.1f}%"),
    ("mem/device", lambda s: _fmt_bytes(s["memory_bytes_per_device"]["total"])),
    ("collectives", lambda s: str(s["collective_count"])),
    ("bytes/device", lambda s: _fmt_bytes(s["collective_bytes_per_device"])),
    (
        "explain",
        lambda s: (
            _fmt_bytes(s["predicted_bytes_per_device"])
            + ("" if s["bytes_match_prediction"] else " (differs)")
            + _accelerator(s)
        ),
    ),
    ("÷ minimum", lambda s: _ratio(s["bytes_over_minimum"])),
    ("÷ gspmd", lambda s: _ratio(s.get("bytes_over_gspmd"))),
    ("÷ jax", lambda s: _ratio(s["overhead_vs_jax"])),
    ("bubble theory/ticks/measured", lambda s: _bubbles(s.get("pipeline"))),
    ("temp/device", lambda s: _fmt_bytes(s["memory_bytes_per_device"]["temporaries"])),
]


def table(summaries: list[dict[str, Any]], sep: str = "  ", markdown: bool = False) -> str:
    rows = [[name for name, _ in COLUMNS]] + [[get(s) for _, get in COLUMNS] for s in summaries]
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
    """Title the chart (and give it a legend in ``legend`` point type), write it to ``path``, close it."""
    ax.set_title(title)
    if legend:
        ax.legend(fontsize=legend)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _bars(plt: Any, summaries: list[dict[str, Any]], labels: list[str], out: Path) -> list[Path]:
    """Step time (with its interquartile range) and bytes per device, one bar per entry."""
    paths = []
    for name, values, errors, ylabel in [
        (
            "step_time.png",
            [s["step_s_median"] * 1e3 for s in summaries],
            [s["step_s_spread"] * 1e3 / 2 for s in summaries],
            "step time (ms, median; bar: interquartile range)",
        ),
        (
            "bytes.png",
            [s["collective_bytes_per_device"] / 2**20 for s in summaries],
            None,
            "collective bytes per device per step (MiB)",
        ),
    ]:
        fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(summaries)), 4))
        ax.bar(range(len(values)), values, yerr=errors, color="#4c72b0", capsize=4)
        ax.set_xticks(range(len(values)), labels, fontsize=8)
        ax.set_ylabel(ylabel)
        paths.append(_save(plt, fig, ax, name.removesuffix(".png").replace("_", " "), out / name))
    return paths


def _time_against_memory(plt: Any, summaries: list[dict[str, Any]], out: Path) -> Path:
    """Step time against memory per device, one colour per model; each model's frontier (the
    layouts no other layout of it beats on both) joined and ringed."""
    fig, ax = plt.subplots(figsize=(7, 5))
    for k, model in enumerate(dict.fromkeys(s["model"] for s in summaries)):
        rows = [s for s in summaries if s["model"] == model]
        points = [(s["memory_bytes_per_device"]["total"] / 2**20, s["step_s_median"] * 1e3) for s in rows]
        colour = f"C{k}"
        ax.scatter(*zip(*points), color=colour, label=model)
        best = frontier(points)
        ax.plot(*zip(*[points[i] for i in best]), color=colour, linestyle="--", linewidth=1)
        ax.scatter(*zip(*[points[i] for i in best]), facecolors="none", edgecolors=colour, s=160)
        for s, (m, t) in zip(rows, points):
            ax.annotate(s["layout"], (m, t), fontsize=7, xytext=(4, 4), textcoords="offset points")
    ax.set_xlabel("memory per device (MiB, compiled)")
    ax.set_ylabel("step time (ms, median)")
    return _save(plt, fig, ax, "step time against memory (ringed: on the frontier)", out / "time_memory.png", legend=8)


def _bytes_by_kind(plt: Any, summaries: list[dict[str, Any]], labels: list[str], out: Path) -> Path:
    """Collective bytes per device, stacked by collective kind (from the compiled HLO)."""
    kinds = list(dict.fromkeys(k for s in summaries for k in s["collectives_measured"]))
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(summaries)), 4))
    bottom = [0.0] * len(summaries)
    for kind in kinds:
        values = [s["collectives_measured"].get(kind, {"bytes": 0.0})["bytes"] / 2**20 for s in summaries]
        ax.bar(range(len(summaries)), values, bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(range(len(summaries)), labels, fontsize=8)
    ax.set_ylabel("bytes per device per step (MiB)")
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
    ax.set_xlabel("microbatches")
    ax.set_ylabel("bubble (fraction of the step)")
    return [_save(plt, fig, ax, "pipeline bubble against microbatches", out / "bubble.png", legend=7)]


def _charts(summaries: list[dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{s['model']}\n{s['layout']}" for s in summaries]
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
    """Write results.json, results.md and the charts into ``out``; return the terminal table and its notes.

    ``unmeasured``: one line per entry skipped or dropped (e.g. ``mlp x dp: skipped, the step does
    not fit: ...``), listed in results.md under "Not measured"."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(summaries, indent=2))
    missing = "".join(f"\n- {line}" for line in unmeasured or [])
    missing = f"\n\nNot measured:{missing}" if missing else ""
    (out / "results.md").write_text(table(summaries, markdown=True) + "\n\n" + notes(summaries) + missing + "\n")
    charts = _charts(summaries, out) if summaries else []
    written = ", ".join(str(p) for p in [out / "results.json", out / "results.md", *charts])
    return table(summaries) + "\n\n" + notes(summaries) + f"\n\nwrote {written}"
