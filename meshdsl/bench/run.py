"""Run the benchmark: compile every model x layout, time them side by side, report.

Timing is interleaved (:mod:`meshdsl.measure.timing`): every round runs every entry once (its
step, and its baseline when asked for), in an order shuffled per round from ``--seed`` (each
summary records the seed and every round's order), and each entry's step time is the median over
rounds, with the spread (75th minus 25th percentile) beside it. Side by side, slow drifts of a
shared machine hit every entry alike. A baseline is timed only where it runs meshdsl's step: its
first losses are checked against meshdsl's first (:func:`meshdsl.bench.baselines.baseline`).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

import meshdsl as md
from meshdsl.analysis import hlo, hlo_flops
from meshdsl.bench import analytic, baselines
from meshdsl.bench.report import write_reports
from meshdsl.errors import ConfigError
from meshdsl.measure import fits
from meshdsl.measure.peaks import peak_flops
from meshdsl.measure.timing import CompiledStep, compile_step, interleaved_rounds, memory_bytes, round_orders
from meshdsl.model import protocol as model_protocol
from meshdsl.model.loader import build_model
from meshdsl.model.protocol import Model, Pipelined
from meshdsl.pipeline import PipelineConfig, bubble, schedule_bubble
from meshdsl.pipeline.run import stages
from meshdsl.runtime import output_paths
from meshdsl.runtime.layout_spec import is_shipped, layout_path, load_layout
from meshdsl.runtime.waiting import Waiting
from meshdsl.train import optim, settings
from meshdsl.train.rules import split_warnings, unused_rules
from meshdsl.train.step import Trainer


@dataclasses.dataclass
class BenchConfig:
    models: list[str] = dataclasses.field(default_factory=lambda: ["transformer"])
    preset: str = "small"
    layouts: list[str] | None = None
    rounds: int = 5
    steps_per_round: int = 3
    baseline: str | None = None
    optimizer: str = "adamw"
    out: str | None = None
    """The results folder (None: a new ``bench-results/run-N``); one holding results already needs ``force``."""
    force: bool = False
    """Write into an ``out`` that holds an earlier run's results (replacing them)."""
    seed: int = 0
    grad_reduce_dtype: str | None = None
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    microbatches: list[int] | None = None
    """Pipelined layouts: the microbatch counts to measure, at a fixed microbatch size (None: the layout's)."""
    schedules: list[str] | None = None
    """Pipelined layouts: the schedules to measure (None: the layout's)."""
    virtual_stages: int | None = None
    """The interleaved schedule's chunks per stage (None: the layout's when it is interleaved, else 2)."""
    gspmd: bool = True
    """Also compile each step on the gspmd backend and count XLA's own partitioner's bytes (the outside anchor)."""


@dataclasses.dataclass
class Entry:
    """One model x layout: what was measured."""

    model: str
    preset: str
    layout: str
    mesh: str
    devices: int
    compile_s: float
    flops_per_step: float | None
    """None for a model without ``flops_per_step()``: no FLOP/s or MFU."""
    examples_per_step: int | None
    """None for a model without ``examples_per_step()``: no throughput."""
    example_unit: str
    memory_bytes: dict[str, int]
    measured: dict[str, dict[str, float]]
    predicted: dict[str, dict[str, float]]
    predicted_on_accelerator: dict[str, dict[str, float]]
    """``predicted`` priced as on an accelerator: differs on CPU only for 16-bit reductions (XLA's
    CPU backend widens them to f32; ``--grad-reduce-dtype bfloat16`` halves them on a GPU or TPU)."""
    minimum_bytes: float | None
    gspmd: dict[str, dict[str, float]] | None = None
    """The collectives of the same step partitioned by XLA (gspmd backend), from its compiled HLO."""
    gspmd_note: str | None = None
    """Why there is no gspmd figure, or how the gspmd step differs, in one line."""
    step_times: list[float] = dataclasses.field(default_factory=list)
    baseline_step_times: list[float] = dataclasses.field(default_factory=list)
    baseline_losses_match: bool | None = None
    """Whether the plain-JAX baseline's first losses equal meshdsl's (None: no baseline was run)."""
    baseline_note: str | None = None
    """Why no baseline was timed, in one line (None: one was, or none was asked for)."""
    timing_seed: int | None = None
    round_orders: list[list[str]] = dataclasses.field(default_factory=list)
    """Every round's order: the labels of the steps timed, entries' and baselines', as they ran."""
    peak_flops: float | None = None
    pipeline: dict[str, Any] | None = None
    """Pipelined layouts: schedule, stages, microbatches and rows per microbatch, bubble fractions."""

    @property
    def step_s(self) -> float:
        return statistics.median(self.step_times)

    @property
    def quartiles_s(self) -> tuple[float, float]:
        """The step time's 25th and 75th percentiles over the rounds."""
        q = np.percentile(self.step_times, [25, 75])
        return float(q[0]), float(q[1])

    @property
    def spread_s(self) -> float:
        """The interquartile range's width (75th minus 25th percentile)."""
        p25, p75 = self.quartiles_s
        return p75 - p25

    @property
    def overhead_spread(self) -> float | None:
        """Spread (75th minus 25th percentile) of the per-round ratios of this step time to the baseline's."""
        if not self.baseline_step_times:
            return None
        q = np.percentile([a / b for a, b in zip(self.step_times, self.baseline_step_times)], [25, 75])
        return float(q[1] - q[0])

    @property
    def measured_bytes(self) -> float:
        return sum(v["bytes"] for v in self.measured.values())

    @property
    def predicted_bytes(self) -> float:
        return sum(v["bytes"] for v in self.predicted.values())

    @property
    def accelerator_bytes(self) -> float:
        return sum(v["bytes"] for v in self.predicted_on_accelerator.values())

    @property
    def moved_bytes(self) -> float:
        """Bytes per device the step moves: the HLO's, except where XLA's CPU backend widens 16-bit sums
        to f32 (``predicted_on_accelerator`` then differs): there ``md.explain``'s accelerator figure,
        the sums in the dtype the program gives them, as the analytic minimum prices them."""
        return self.measured_bytes if self.accelerator_bytes == self.predicted_bytes else self.accelerator_bytes

    @property
    def gspmd_bytes(self) -> float | None:
        return None if self.gspmd is None else sum(v["bytes"] for v in self.gspmd.values())

    @property
    def bytes_over_gspmd(self) -> float | None:
        """The HLO's bytes over XLA's partitioner's (1.0 where both move nothing; None where only XLA moves nothing)."""
        gspmd = self.gspmd_bytes
        if gspmd is None or (gspmd == 0 and self.measured_bytes):
            return None
        return 1.0 if gspmd == 0 else self.measured_bytes / gspmd

    @property
    def collectives(self) -> int:
        return int(sum(v["count"] for v in self.measured.values()))

    def summary(self) -> dict[str, Any]:
        """Every reported field, JSON-ready."""
        flops_per_s = None if self.flops_per_step is None else self.flops_per_step / self.step_s
        baseline = statistics.median(self.baseline_step_times) if self.baseline_step_times else None
        return {
            "model": self.model,
            "preset": self.preset,
            "layout": self.layout,
            "mesh": self.mesh,
            "devices": self.devices,
            "compile_s": self.compile_s,
            "step_s_median": self.step_s,
            "step_s_spread": self.spread_s,
            "step_s_p25": self.quartiles_s[0],
            "step_s_p75": self.quartiles_s[1],
            "examples_per_step": self.examples_per_step,
            "example_unit": self.example_unit,
            "step_times_s": self.step_times,
            f"{self.example_unit}_per_s": None
            if self.examples_per_step is None
            else self.examples_per_step / self.step_s,
            "flops_per_step": self.flops_per_step,
            "flops_per_s": flops_per_s,
            "mfu": None
            if self.peak_flops is None or flops_per_s is None
            else flops_per_s / (self.peak_flops * self.devices),
            "memory_bytes_per_device": self.memory_bytes,
            "collectives_measured": self.measured,
            "collectives_predicted": self.predicted,
            "collective_count": self.collectives,
            "collective_bytes_per_device": self.measured_bytes,
            "predicted_bytes_per_device": self.predicted_bytes,
            "predicted_bytes_per_device_on_accelerator": self.accelerator_bytes,
            "bytes_match_prediction": self.measured == self.predicted,
            "analytic_minimum_bytes": self.minimum_bytes,
            "bytes_over_minimum": None if not self.minimum_bytes else self.moved_bytes / self.minimum_bytes,
            "collectives_gspmd": self.gspmd,
            "gspmd_bytes_per_device": self.gspmd_bytes,
            "bytes_over_gspmd": self.bytes_over_gspmd,
            "gspmd_note": self.gspmd_note,
            "baseline_jax_step_s": baseline,
            "baseline_jax_step_times_s": self.baseline_step_times,
            "baseline_losses_match": self.baseline_losses_match,
            "baseline_note": self.baseline_note,
            "overhead_vs_jax": None if baseline is None else self.step_s / baseline,
            "overhead_vs_jax_spread": self.overhead_spread,
            "timing_seed": self.timing_seed,
            "round_orders": self.round_orders,
            "pipeline": self.pipeline,
        }


def _layout_specs(names: list[str] | None, model: Model, model_name: str) -> list[str]:
    """The layouts asked for (files anywhere, shipped names, inline rules: as ``train --layout``
    takes them), or the shipped ones the model lists in ``LAYOUTS``."""
    if names:
        return list(names)
    listed = model_protocol.layouts(model)
    if listed is None:
        raise ConfigError(
            f"model {model_name} lists no LAYOUTS (the layouts bench runs by default); "
            "name them, e.g. --layouts data_parallel fsdp my_layout.toml"
        )
    return list(listed)


def _label(spec: str) -> str:
    """A layout's name in the report: its file's stem, or the inline rules."""
    path = layout_path(spec)
    return spec if path is None else path.stem


def notes(model: Model, name: str) -> list[str]:
    """What bench cannot report for ``model`` (named ``name``) because it lacks an optional part."""
    return model_protocol.step_counts(model).notes(name)


def check(cfg: BenchConfig, models: list[tuple[str, Any]] | None = None) -> list[tuple[str, Any]]:
    """Raise the md error for each mistake in ``cfg`` that shows before any device is used: counts,
    models, presets, overrides, optimizer, every layout file, and the report folder. Returns each model
    with its name (in ``cfg.models``' order), built to check it, so :func:`run` builds each once
    (``models``: those, when a caller's earlier check built them)."""
    for flag, value in (("--rounds", cfg.rounds), ("--steps-per-round", cfg.steps_per_round)):
        if value < 1:
            raise ConfigError(
                f"{flag} {value}: it must be at least 1 (every entry is timed rounds x steps-per-round steps)"
            )
    for m in cfg.microbatches or []:
        PipelineConfig(m)
    if cfg.virtual_stages is not None:
        PipelineConfig(1, "interleaved", cfg.virtual_stages)
    optim.make(cfg.optimizer)
    if models is None:
        models = [(name, build_model(name, cfg.preset, **cfg.overrides)) for name in cfg.models]
    for model_name, model in models:
        for spec in _layout_specs(cfg.layouts, model, model_name):
            load_layout(spec)
    output_paths.check_dir(results_dir(cfg), "--out")
    return models


RESULTS = Path("bench-results")
"""Where runs without ``--out`` go, each in a new ``run-N`` folder."""


def results_dir(cfg: BenchConfig) -> Path:
    """The folder this run writes: ``cfg.out``, or the next free ``bench-results/run-N``. ConfigError when
    ``cfg.out`` holds an earlier run's results and ``cfg.force`` is not set (nothing is overwritten unasked)."""
    if cfg.out is None:
        taken = [int(p.name[4:]) for p in RESULTS.glob("run-*") if p.name[4:].isdigit()]
        return RESULTS / f"run-{max(taken, default=0) + 1}"
    if not cfg.out:
        raise ConfigError("--out is empty: name a folder, or leave --out out for a new bench-results/run-N")
    out = Path(cfg.out)
    if (out / "results.json").exists() and not cfg.force:
        raise ConfigError(
            f"--out {cfg.out!r} holds an earlier run's results (results.json); pass --force to replace them, "
            "or leave --out out for a new bench-results/run-N"
        )
    return out


def _pipeline_variants(cfg: BenchConfig, spec: str, model: Model) -> list[tuple[PipelineConfig, int] | None]:
    """For a layout that splits ``layers``: each schedule x microbatch count asked for, with its batch
    (microbatches x the rows per microbatch of the layout's own setting); else ``[None]``."""
    layout = load_layout(spec)
    if not layout.axes_of("layers"):
        return [None]
    own = layout.pipeline
    rows = model.config.batch // own.microbatches
    v = cfg.virtual_stages or (own.virtual_stages if own.schedule == "interleaved" else 2)
    return [
        (own.replace(m, s, v if s == "interleaved" else 1), rows * m)
        for s in (cfg.schedules or [own.schedule])
        for m in (cfg.microbatches or [own.microbatches])
    ]


def _prepare(
    model_name: str,
    model: Model,
    cfg: BenchConfig,
    spec: str,
    out: Callable[[str], None],
    variant: tuple[PipelineConfig, int] | None = None,
) -> tuple[Entry, Callable, Callable | None] | None:
    """Compile one model x layout (x pipeline variant: the model rebuilt for its batch); None (with a note)
    when the layout does not fit the model."""
    layout = load_layout(spec)
    assumed = model_settings(spec)
    if variant is not None or assumed:
        batch = {} if variant is None else {"batch": variant[1]}
        model = build_model(model_name, cfg.preset, **{**cfg.overrides, **assumed, **batch})
    name = _label(spec)
    label = name if variant is None else f"{name}[{_schedule_label(variant[0])} M={variant[0].microbatches}]"
    optimizer = optim.make(cfg.optimizer)
    try:
        mesh = layout.mesh()
        pipe = None if variant is None else variant[0]
        trainer = Trainer(model, optimizer, mesh, layout, grad_reduce_dtype=cfg.grad_reduce_dtype, pipeline=pipe)
        step = compile_step(trainer, cfg.seed, what="the step")
    except fits.DoesNotFit as e:
        out(f"  {model_name} x {label}: skipped, {e}")
        return None
    except (md.LayoutError, md.ConfigError) as e:  # ConfigError: a pipeline the model or batch cannot take
        out(f"  {model_name} x {label}: skipped, the layout does not fit: {e}")
        return None
    trainer, state, data = step.trainer, step.state, step.data
    text = step.compiled.as_text()
    device = jax.devices()[0]
    dtype = model_protocol.compute_dtype(model)
    counts = model_protocol.step_counts(model)
    narrow_on_cpu = device.platform == "cpu" and (cfg.grad_reduce_dtype is not None or jnp.dtype(dtype).itemsize < 4)
    predicted = trainer.explain(state, data).summary()
    entry = Entry(
        model=model_name,
        preset=cfg.preset,
        layout=label,
        mesh=str(mesh),
        devices=mesh.size,
        compile_s=step.compile_s,
        flops_per_step=counts.flops,
        examples_per_step=counts.examples,
        example_unit=counts.unit,
        memory_bytes=memory_bytes(step.compiled),
        measured=hlo.summary(text, num_devices=mesh.size),
        predicted=predicted,
        predicted_on_accelerator=trainer.explain(state, data, platform="gpu").summary() if narrow_on_cpu else predicted,
        minimum_bytes=analytic.minimum_bytes(model, state["params"], mesh, layout, optimizer, cfg.grad_reduce_dtype),
        peak_flops=peak_flops(device.device_kind, dtype),
        pipeline=None if pipe is None else _pipeline_fields(pipe, trainer, cast(Pipelined, model), text),
    )
    if cfg.gspmd:
        entry.gspmd, entry.gspmd_note = _gspmd(step, cfg.grad_reduce_dtype)
    plain = None
    if cfg.baseline == "jax":
        checked = baselines.baseline(step)
        entry.baseline_losses_match, entry.baseline_note, plain = checked.losses_match, checked.note, checked.step
        if checked.note is not None:
            out(f"  {model_name} x {label}: plain-JAX baseline not timed: {checked.note}")
    return entry, step, plain


def model_settings(spec: str) -> dict[str, Any]:
    """The model settings a layout file's ``[train]`` table sets (``remat``, ``compute_dtype``: what ``meshdsl
    search`` assumed when it wrote the file), which bench applies as train does; empty for inline rules."""
    table = settings.train_table(layout_path(spec))
    return {k: table[k] for k in ("remat", "compute_dtype") if k in table}


def _gspmd(step: CompiledStep, grad_reduce_dtype: str | None) -> tuple[dict[str, dict[str, float]] | None, str | None]:
    """The collectives XLA's partitioner gives the same step (same state, data and layout, gspmd
    backend), read from its compiled HLO; None and why for a step it cannot run."""
    trainer = step.trainer
    if trainer.pipelined:
        return None, "XLA's partitioner does not pipeline, so there is no gspmd figure for a pipelined step"
    # An [attention] strategy needs meshdsl's collectives: XLA partitions the same rules' attention itself.
    strategies = {a: s for a, s in trainer.layout.attention.items() if s == "all_gather"}
    layout = md.Layout(trainer.layout, attention=strategies)
    gspmd = Trainer(trainer.model, trainer.optimizer, trainer.mesh, layout, backend="gspmd", donate=False)
    text = gspmd.step.lower(step.state, step.data).compile().as_text()
    if text is None:
        return None, "the backend gives no HLO text of the compiled gspmd step"
    notes = (
        []
        if grad_reduce_dtype is None
        else [f"the gspmd step sums gradients in their own dtype, not {grad_reduce_dtype}"]
    )
    if layout != trainer.layout:
        notes.append("the gspmd step leaves attention to XLA's partitioner (the layout's [attention] needs spmd)")
    note = "; ".join(notes) or None
    return hlo.summary(text, num_devices=trainer.mesh.size), note


def _schedule_label(pipe: PipelineConfig) -> str:
    """``1f1b``, ``gpipe``, or ``interleaved v=2``."""
    return pipe.schedule + (f" v={pipe.virtual_stages}" if pipe.schedule == "interleaved" else "")


def _pipeline_fields(pipe: PipelineConfig, trainer: Trainer, model: Pipelined, hlo_text: str) -> dict[str, Any]:
    """Schedule, stages, microbatches, bubbles (theory, the timetable's ticks) and the compiled step's
    matmul FLOPs per device (loops counted by their trip counts: :mod:`meshdsl.analysis.hlo_flops`)."""
    from meshdsl.lowering.spmd import SpmdLowering

    p = stages(SpmdLowering(trainer.mesh, trainer.layout), model.layers)[1]
    m, v = pipe.microbatches, pipe.virtual_stages
    return {
        "schedule": pipe.schedule,
        "virtual_stages": v,
        "stages": p,
        "microbatches": m,
        "microbatch_rows": model.config.batch // m,
        "bubble_theoretical": bubble(p, m, v),
        "bubble_schedule": schedule_bubble(pipe.schedule, p, m, v),
        "bubble_measured": None,
        "matmul_flops_per_device": hlo_flops.matmul_flops(hlo_text),
    }


def _measure_bubbles(entries: list[Entry]) -> None:
    """Measured bubble fraction of pipelined entries: ``1 - a M / t(M)``, with ``t(M) = a M + c`` fitted
    (least squares) over the microbatch counts measured for one model x layout x schedule. ``c`` is
    the step time that does not grow with M at a fixed microbatch size: pipeline fill and drain,
    plus per-step work such as the optimizer. Needs two or more microbatch counts."""
    groups: dict[tuple, list[tuple[Entry, dict[str, Any]]]] = {}
    for e in entries:
        if e.pipeline is not None:
            groups.setdefault((e.model, e.layout.split("[")[0], e.pipeline["schedule"]), []).append((e, e.pipeline))
    for group in groups.values():
        ms = [pipe["microbatches"] for _, pipe in group]
        if len(set(ms)) < 2:
            continue
        slope, _ = np.polyfit(ms, [e.step_s for e, _ in group], 1)
        for (e, pipe), m in zip(group, ms):
            pipe["bubble_measured"] = 1 - slope * m / e.step_s


def _time(
    prepared: list[tuple[Entry, Callable, Callable | None]], cfg: BenchConfig, out: Callable[[str], None] = print
) -> list[str]:
    """Time every entry's step and baseline in interleaved rounds; record each round's order on every entry.

    A step that runs out of device memory at run time is reported (``out``) and left out of the
    later rounds; the labels of the entries that lost their own step that way are returned (their
    baselines lose only the baseline's timing, with a note)."""
    timed = [(entry.step_times, step, _name(entry)) for entry, step, _ in prepared]
    timed += [
        (entry.baseline_step_times, plain, f"{_name(entry)} (plain JAX)")
        for entry, _, plain in prepared
        if plain is not None
    ]
    orders = round_orders(len(timed), cfg.rounds, cfg.seed)
    failed: dict[int, BaseException] = {}
    rounds = Waiting("meshdsl bench", f"timing rounds of {len(timed)} steps x {cfg.steps_per_round}", cfg.rounds, 0)
    rounds.show("warming up")
    samples = interleaved_rounds(
        [step for _, step, _ in timed],
        orders,
        cfg.steps_per_round,
        failed,
        on_round=lambda r: rounds.advance() if r else rounds.show("warmed up", force=True),
    )
    for i, error in failed.items():
        out(f"  dropped: {fits.run_time_message(timed[i][2], error)}")
        samples[i].clear()
    for (times, _, _), seconds in zip(timed, samples):
        times.extend(seconds)
    labelled = [[timed[i][2] for i in order] for order in orders]
    for entry, _, _ in prepared:
        entry.timing_seed, entry.round_orders = cfg.seed, labelled
        if entry.baseline_note is None and entry.baseline_losses_match and not entry.baseline_step_times:
            entry.baseline_note = "the plain-JAX step ran out of device memory at run time"
    return [timed[i][2] for i in failed if i < len(prepared)]


def device_peak_bytes() -> int | None:
    """The most memory the first local device has held since the process started, by its own count
    (``memory_stats()["peak_bytes_in_use"]``: every entry compiled and timed so far, not one
    entry's); None where the device keeps no such count (XLA's CPU devices)."""
    stats = jax.local_devices()[0].memory_stats()
    return None if not stats or "peak_bytes_in_use" not in stats else int(stats["peak_bytes_in_use"])


def _layout_warnings(spec: str, model: Model, name: str) -> list[str]:
    """What train warns about a layout: a user's rules naming no dim of the model, and a layout (shipped ones
    too, such as ``spatial`` on the transformer) that splits nothing, or neither the batch nor half the
    parameters, on its mesh."""
    layout = load_layout(spec)
    unused = [] if is_shipped(layout_path(spec)) else unused_rules(layout, model, name)
    try:
        mesh = layout.mesh()
    except (md.LayoutError, md.ConfigError):  # reported when the entry is compiled and skipped
        return unused
    return [*unused, *split_warnings(layout, mesh, model, name, warned=bool(unused))]


def _name(entry: Entry) -> str:
    return f"{entry.model} x {entry.layout}"


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def run(
    cfg: BenchConfig,
    out: Callable[[str], None] = print,
    warn: Callable[[str], None] = _stderr,
    models: list[tuple[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Benchmark as ``cfg`` says; print the table, write reports to ``cfg.out``; return the summaries.

    Mistakes in ``cfg`` raise before anything is compiled (:func:`check`); rules of a user's layout
    that name no dim of a model are warned about (``warn``); ConfigError when every layout is skipped.
    ``models``: what ``check(cfg)`` returned, when the caller checked first (not built again).
    """
    models = check(cfg, models)
    lines: list[str] = []

    def out_and_keep(line: str) -> None:  # what was skipped or dropped also goes under the reports' tables
        if ": skipped, " in line or line.startswith("  dropped: "):
            lines.append(line.strip())
        out(line)

    devices = jax.devices()
    out(f"meshdsl bench: {len(devices)} x {devices[0].device_kind} ({devices[0].platform})")
    prepared, skipped = [], []
    total = sum(
        len(_pipeline_variants(cfg, spec, model))
        for model_name, model in models
        for spec in _layout_specs(cfg.layouts, model, model_name)
    )
    compiling = Waiting("meshdsl bench", "entries compiled", total, every=0)
    for model_name, model in models:
        for note in notes(model, model_name):
            warn(f"meshdsl bench: note: {note}")
        for spec in _layout_specs(cfg.layouts, model, model_name):
            for warning in _layout_warnings(spec, model, model_name):
                warn(f"meshdsl bench: warning: {warning}")
            for variant in _pipeline_variants(cfg, spec, model):
                compiling.show(f"compiling {model_name} x {_label(spec)}")
                item = _prepare(model_name, model, cfg, spec, out_and_keep, variant)
                compiling.done += 1
                if item is None:
                    skipped.append(f"{model_name} x {_label(spec)}")
                else:
                    prepared.append(item)
                    out(f"  compiled {model_name} x {item[0].layout} in {item[0].compile_s:.1f} s")
    if not prepared:
        names = ", ".join(dict.fromkeys(skipped))
        raise ConfigError(
            f"nothing to measure: every layout was skipped as not fitting the model or the device's memory ({names}; "
            "see why above)"
        )
    lost = _time(prepared, cfg, out_and_keep)
    prepared = [item for item in prepared if _name(item[0]) not in lost]
    if not prepared:
        raise ConfigError(
            f"nothing measured: every entry ran out of device memory at run time ({', '.join(lost)}; see above)"
        )
    _measure_bubbles([entry for entry, _, _ in prepared])
    peak = device_peak_bytes()
    summaries = [{**entry.summary(), "device_peak_bytes_in_use": peak} for entry, _, _ in prepared]
    if jax.process_index() == 0:  # a multi-process run: process 0 writes the reports
        folder = results_dir(cfg)
        with output_paths.writing(f"the reports in {str(folder)!r}", "the table above holds the results"):
            out(write_reports(summaries, folder, lines))
    return summaries
