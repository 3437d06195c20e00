"""The benchmark's answer in words: per model, the fastest layout, its margin over the next with the
spread, the layout with least memory per device, and why the winner wins.

Generic over the entries it gets (any model, layout, pipeline variant or extra row): it ranks
summaries (:meth:`meshdsl.bench.run.Entry.summary`'s dicts) by their median step time and their
compiled memory per device. The reason is read from the entry's compiled HLO collectives
(``collectives_measured``): the kind that moves the most bytes, or "compute-bound" where the
winner moves no more bytes than the runner-up yet is faster (its compute is what differs).
"""

from __future__ import annotations

from typing import Any

from meshdsl.measure.fits import readable


def mib(nbytes: float) -> str:
    """Bytes in the largest binary unit keeping them at least 1, to 3 significant figures (small figures do not
    read as 0)."""
    return readable(nbytes)


def quartiles_ms(s: dict[str, Any]) -> str:
    """The step time's interquartile range, ``p25-p75`` in ms."""
    return f"{s['step_s_p25'] * 1e3:,.1f}-{s['step_s_p75'] * 1e3:,.1f} ms"


def dominant_kind(s: dict[str, Any]) -> tuple[str, float] | None:
    """The collective kind moving the most bytes per device in the compiled step, and its share (None: none moves)."""
    kinds = {k: v["bytes"] for k, v in s["collectives_measured"].items() if v["bytes"] > 0}
    if not kinds:
        return None
    kind = max(kinds, key=lambda k: kinds[k])
    return kind, kinds[kind] / sum(kinds.values())


def why(best: dict[str, Any], runner_up: dict[str, Any] | None) -> str:
    """One sentence on why ``best`` is fastest: what it moves (its dominant collective), against the next."""
    moved = best["collective_bytes_per_device"]
    top = dominant_kind(best)
    what = (
        "moves no collective bytes" if top is None else f"moves {mib(moved)} per device per step, {top[1]:.0%} {top[0]}"
    )
    if runner_up is None:
        return f"{best['layout']} {what}."
    other = runner_up["collective_bytes_per_device"]
    if moved < other:
        return f"{best['layout']} {what}, less than {runner_up['layout']}'s {mib(other)}: communication decides."
    return (
        f"{best['layout']} {what}, no less than {runner_up['layout']}'s {mib(other)}, yet is faster: "
        "compute-bound (how the layout splits the work decides, not the bytes moved)."
    )


def _per_example(rows: list[dict[str, Any]]) -> bool:
    """Whether ``rows`` run different batches (pipelined variants grow the batch with the microbatch count),
    so they are ranked by time per example, not per step."""
    sizes = {s.get("examples_per_step") for s in rows}
    return len(sizes) > 1 and None not in sizes


def _model_verdict(model: str, rows: list[dict[str, Any]]) -> list[str]:
    by_example = _per_example(rows)
    ranked = sorted(rows, key=lambda s: s["step_s_median"] / (s["examples_per_step"] if by_example else 1))
    best = ranked[0]
    lines = [f"{model}: fastest {best['layout']}, {best['step_s_median'] * 1e3:,.1f} ms (IQR {quartiles_ms(best)})"]
    if by_example:
        lines.insert(0, f"{model}: the entries run different batches, so they are ranked by time per example")
    runner_up = ranked[1] if len(ranked) > 1 else None
    if runner_up is not None:
        scale = runner_up["examples_per_step"] / best["examples_per_step"] if by_example else 1
        gap = runner_up["step_s_median"] / (best["step_s_median"] * scale) - 1
        overlap = runner_up["step_s_p25"] <= best["step_s_p75"] * scale
        lines[-1] += (
            f", {gap:.0%} ahead of {runner_up['layout']} ({runner_up['step_s_median'] * 1e3:,.1f} ms, IQR "
            f"{quartiles_ms(runner_up)})" + ("; the ranges overlap, so the lead is within the noise" if overlap else "")
        )
    else:
        lines[-1] += " (the only layout measured)"
    small = min(rows, key=lambda s: s["memory_bytes_per_device"]["total"])
    lines.append(
        f"  least memory per device: {small['layout']}, {mib(small['memory_bytes_per_device']['total'])} (compiled)"
    )
    lines.append(f"  why: {why(best, runner_up)}")
    return lines


def verdict(summaries: list[dict[str, Any]]) -> str:
    """The verdict block: a header naming the preset(s) and devices, then each model's lines."""
    if not summaries:
        return "verdict: nothing was measured"
    presets = ", ".join(dict.fromkeys(s["preset"] for s in summaries))
    devices = ", ".join(dict.fromkeys(str(s["devices"]) for s in summaries))
    lines = [f"verdict (preset {presets}, {devices} devices, median step time over the rounds):"]
    for model in dict.fromkeys(s["model"] for s in summaries):
        lines += _model_verdict(model, [s for s in summaries if s["model"] == model])
    return "\n".join(lines)
