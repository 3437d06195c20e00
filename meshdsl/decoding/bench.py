"""``meshdsl bench --decode``: time prefill and per-token decode of one model under each layout, side by side.

Each layout decodes ``batch`` random prompts of ``prompt`` ids by ``new`` tokens (greedy) once to
compile, then ``rounds`` times timed, in interleaved rounds (layout A, B, C, A, ...); the
figures are medians. Per layout: prefill tokens/s, decode tokens/s (rows x timed steps / their
seconds), the compiled decode step's memory per device (XLA's ``memory_analysis``: arguments,
outputs and temporaries, the donated cache once), the bytes its collectives move per device per
decoded token (``md.explain`` of the decode step over the rows), and a verdict naming the layout
that decodes fastest. Decoding is memory-bound at small batches: the layouts that are fastest to
train are not necessarily fastest here.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

import meshdsl as md
from meshdsl.decoding.decoder import Decoder
from meshdsl.decoding.generate import Generation, run
from meshdsl.errors import ConfigError
from meshdsl.measure.fits import readable
from meshdsl.measure.timing import memory_bytes
from meshdsl.model.protocol import Decoding, Model


@dataclasses.dataclass(frozen=True)
class DecodeBench:
    """Rows, prompt ids and new tokens per run, and timed rounds."""

    batch: int = 8
    prompt: int = 8
    new: int = 8
    rounds: int = 3

    def check(self, positions: int) -> None:
        """ConfigError for a count below 1 (2 new tokens: one decode step is timed after the one that
        compiles), or a prompt plus new tokens past the model's ``positions``."""
        for flag, value, least in (
            ("--decode-batch", self.batch, 1),
            ("--prompt-length", self.prompt, 1),
            ("--new-tokens", self.new, 3),
            ("--rounds", self.rounds, 1),
        ):
            if value < least:
                raise ConfigError(f"bench --decode: {flag} {value}: it must be at least {least}")
        if self.prompt + self.new > positions:
            raise ConfigError(
                f"bench --decode: --prompt-length {self.prompt} + --new-tokens {self.new} is more than the model's "
                f"{positions} positions (--set length=N)"
            )


@dataclasses.dataclass
class Row:
    """One layout's figures."""

    layout: str
    decoder: Decoder
    params: Any
    memory: int
    collective_bytes: float
    report: md.Report
    prefill_s: list[float] = dataclasses.field(default_factory=list)
    step_s: list[float] = dataclasses.field(default_factory=list)


def _step_inputs(decoder: Decoder, cfg: DecodeBench) -> tuple[md.Tensor, dict, dict]:
    """A decode step's tokens, cache and step inputs at the run's full cache length."""
    memory = cfg.prompt + cfg.new
    tokens, step = decoder.step_inputs(
        jnp.zeros((cfg.batch, 1), jnp.int32), memory - 1, jnp.zeros((cfg.batch, 1)), jnp.ones((cfg.batch, memory), bool)
    )
    return tokens, decoder.cache(cfg.batch, memory), step


def _prepare(model: Decoding, label: str, layout: md.Layout, cfg: DecodeBench, backend: str, seed: int) -> Row:
    mesh = layout.mesh()
    decoder = Decoder(model, mesh, layout, backend)
    params = decoder.place(model.init(jax.random.key(seed)))
    tokens, cache, step = _step_inputs(decoder, cfg)
    compiled = decoder.step.lower(params, tokens, cache, step).compile()
    stored = layout.param_layout
    report = md.explain(model.decode, mesh, layout, params, tokens, cache, step, in_layouts=(stored, None, None, None))
    memory = memory_bytes(compiled)["total"]  # the donated cache counted once (aliased)
    return Row(label, decoder, params, memory, report.total_bytes / cfg.batch, report)


def _time(row: Row, prompts: list[list[int]], new: int) -> Generation:
    return run(row.decoder, row.params, prompts, new)


def layouts_of(names: list[str] | None, model: Model, model_name: str) -> list[tuple[str, md.Layout]]:
    """``(label, layout)`` of each layout asked for (as ``bench --layouts`` takes them), or the model's ``LAYOUTS``."""
    from meshdsl.model import protocol
    from meshdsl.runtime.layout_spec import layout_path, load_layout

    specs = list(names) if names else list(protocol.layouts(model) or [])
    if not specs:
        raise ConfigError(f"bench --decode: model {model_name} lists no LAYOUTS; name them with --layouts")
    labelled = []
    for spec in specs:
        path = layout_path(spec)
        labelled.append((spec if path is None else path.stem, load_layout(spec)))
    return labelled


def bench(
    model: Model,
    layouts: list[tuple[str, md.Layout]],
    cfg: DecodeBench,
    backend: str = "spmd",
    seed: int = 0,
    out: Callable[[str], None] = print,
) -> list[Row]:
    """Time ``model`` decoding under each of ``layouts`` (label, layout); print the table and the verdict."""
    prompts = np.random.default_rng(seed).integers(0, model.config.vocab, (cfg.batch, cfg.prompt)).tolist()
    rows = []
    for label, layout in layouts:
        try:
            row = _prepare(cast(Decoding, model), label, layout, cfg, backend, seed)  # Decoder checks it
        except (md.LayoutError, md.ConfigError) as e:
            out(f"  {label}: skipped, the layout does not fit: {e}")
            continue
        _time(row, prompts, cfg.new)  # compiles prefill and decode
        rows.append(row)
    for _ in range(cfg.rounds):
        for row in rows:
            g = _time(row, prompts, cfg.new)
            row.prefill_s.append(g.prefill_seconds)
            row.step_s.append(g.decode_seconds / g.steps)
    out(table(rows, cfg))
    if rows:
        out(verdict(rows, cfg))
        best = max(rows, key=lambda r: _decode_rate(r, cfg))
        out(f"\nmd.explain of {best.layout}'s decode step (per device):\n{best.report}")
    return rows


def _decode_rate(row: Row, cfg: DecodeBench) -> float:
    return cfg.batch / statistics.median(row.step_s)


def table(rows: list[Row], cfg: DecodeBench) -> str:
    """The markdown table of the rows."""
    lines = [
        f"decode: batch {cfg.batch}, prompt {cfg.prompt} ids, {cfg.new} new tokens, median of {cfg.rounds} rounds",
        "",
        "| layout | prefill tokens/s | decode step | decode tokens/s | memory per device | collective bytes/token |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        prefill = cfg.batch * cfg.prompt / statistics.median(r.prefill_s)
        step = statistics.median(r.step_s)
        lines.append(
            f"| {r.layout} | {prefill:,.0f} | {step * 1e3:.2f} ms | {_decode_rate(r, cfg):,.0f} | "
            f"{readable(r.memory)} | {readable(r.collective_bytes)} |"
        )
    return "\n".join(lines)


def verdict(rows: list[Row], cfg: DecodeBench) -> str:
    """Which layout decodes fastest, and by how much over the slowest."""
    ranked = sorted(rows, key=lambda r: _decode_rate(r, cfg), reverse=True)
    best, worst = ranked[0], ranked[-1]
    ratio = _decode_rate(best, cfg) / _decode_rate(worst, cfg)
    order = " > ".join(r.layout for r in ranked)
    return (
        f"verdict: {best.layout} decodes fastest ({_decode_rate(best, cfg):,.0f} tokens/s, {ratio:.2f}x "
        f"{worst.layout}); ranked: {order}"
    )
