"""``meshdsl gpu-check``: the prepared check of one GPU, every figure into one markdown and one JSON file.

Steps, each timed, each one's failure a line in the file that does not stop the others, with
the seconds each is budgeted on one H100 or H200 (:data:`BUDGET_S`; compiles dominate):

1. the environment (device, JAX version, date): 5 s;
2. cuDNN's fused attention against XLA's formula (bf16, causal; only on a GPU): 30 s;
3. ``meshdsl calibrate`` into a profile (matmul rates in bf16 and f32, memory bandwidth, the
   fused attention's rate): 90 s;
4. the 1b preset at batch 8, bf16 compute, AdamW, ``data_parallel``, with ``--baseline jax``,
   the planner's prediction (the calibrated profile and the shipped one) beside it: 120 s;
5. the same at batch 16: 130 s;
6. the README's main job (``meshdsl bench``: the Transformer's shipped layouts, small preset,
   no gspmd column): 60 s.

435 s in all, under 8 minutes with room for the machine's start. A step starts only while the
run has its budget left (:data:`TOTAL_S` from the first step): else it is recorded as skipped,
so a slow device still leaves a report of what it measured. ``--dry`` runs the same steps on
the devices at hand at tiny sizes (the ``tiny`` preset, one layout, one round), with no
budget; the test suite runs it on CPU. The files are rewritten after every step, so a run cut
short keeps what it measured. JAX is imported inside the steps, after the CLI has chosen the
devices.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What a full run and a dry run measure."""

    main_model: str
    main_preset: str
    main_layouts: list[str] | None
    big_preset: str
    batches: tuple[int, ...]
    rounds: int
    steps_per_round: int
    attention: tuple[int, int, int, int]
    """Batch, heads, length, head size of the attention comparison."""
    calibrate: dict[str, tuple[int, ...]] | None
    """``calibrate``'s sizes (None: its own, which saturate the device)."""


FULL = Sizes("transformer", "small", None, "1b", (8, 16), 3, 2, (4, 16, 2048, 128), None)
TOTAL_S = 450.0
"""Seconds the full run may take from its first step (under 8 minutes with the machine's start)."""
BUDGET_S = {"environment": 5, "attention": 30, "calibrate": 90, "batch 8": 120, "batch 16": 130, "main job": 60}
"""Seconds each step of the full run is budgeted (module docstring); a step starts only if the run has them left."""
DRY = Sizes(
    "mlp",
    "tiny",
    ["data_parallel"],
    "tiny",
    (8,),
    1,
    1,
    (2, 2, 16, 8),
    {
        "matmul_sizes": (64, 128),
        "bandwidth_sizes": (2**16, 2**18),
        "collective_sizes": (2**12, 2**14),
        "attention_lengths": (16, 32),
    },
)


def check(args: argparse.Namespace) -> None:
    """The report's files and folder can be written (before any device is used); ConfigError if not."""
    from meshdsl.errors import ConfigError
    from meshdsl.runtime import output_paths

    if Path(args.out).suffix != ".md":
        raise ConfigError(
            f"--out {args.out!r}: the report is markdown, name it FILE.md (its .json and folder FILE/ go beside it)"
        )
    output_paths.check_file(args.out, "--out")
    output_paths.check_file(_json_path(args.out), "--out's .json")
    output_paths.check_dir(Path(args.out).with_suffix(""), "--out's folder")


def _json_path(out: str | Path) -> Path:
    return Path(out).with_suffix(".json")


@dataclasses.dataclass
class Report:
    """The steps run so far; written to ``path`` (markdown) and its ``.json`` after each."""

    path: Path
    dry: bool
    steps: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    deadline: float | None = None
    """``time.perf_counter()`` by which the run ends (None: no budget)."""

    def step(
        self, title: str, body: Callable[[], dict[str, Any]], out: Callable[[str], None], budget: float = 0.0
    ) -> dict[str, Any] | None:
        """Run ``body`` as the step ``title``: its result, or None (its error recorded in one line);
        skipped when fewer than ``budget`` seconds of the run's budget are left."""
        out(f"meshdsl gpu-check: {title} ...")
        start = time.perf_counter()
        left = None if self.deadline is None else self.deadline - start
        if left is not None and left < budget:
            why = (
                f"skipped: {max(left, 0):.0f} s of the run's {TOTAL_S:.0f} s left, the step is budgeted {budget:.0f} s"
            )
            out(f"meshdsl gpu-check: {title} {why}")
            self.steps.append({"step": title, "seconds": 0.0, "error": why, "result": None})
            self.write()
            return None
        try:
            result, error = body(), None
        except Exception as e:  # one step's failure is recorded, the others still run
            result, error = None, f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
            out(f"meshdsl gpu-check: {title} failed: {error}")
        self.steps.append({"step": title, "seconds": time.perf_counter() - start, "error": error, "result": result})
        self.write()
        return result

    def write(self) -> None:
        data = {"dry": self.dry, "steps": self.steps}
        _json_path(self.path).write_text(json.dumps(data, indent=2, default=str) + "\n")
        self.path.write_text(markdown(self.steps, self.dry))


def _environment() -> dict[str, Any]:
    import jax

    device = jax.devices()[0]
    return {
        "device": f"{jax.device_count()} x {device.device_kind} ({device.platform})",
        "jax": jax.__version__,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _attention(sizes: Sizes) -> dict[str, Any]:
    """cuDNN's fused attention (meshdsl's default on a GPU) against XLA's formula, bf16, causal."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import meshdsl as md

    if jax.default_backend() not in ("gpu", "cuda"):
        return {"skipped": "no GPU: only XLA's formula runs here"}
    b, n, t, h = sizes.attention
    keys = jax.random.split(jax.random.key(0), 3)
    names = ["batch heads length d_kv", "batch heads memory d_kv", "batch heads memory d_kv"]
    q, k, v = (md.tensor(jax.random.normal(key, (b, n, t, h), jnp.bfloat16), name) for key, name in zip(keys, names))

    def run(implementation: str | None) -> np.ndarray:
        fn = jax.jit(lambda q, k, v: md.nn.dot_product_attention(q, k, v, causal=True, implementation=implementation))
        return np.asarray(fn(q, k, v).array, np.float32)

    fused, formula = run(None), run("xla")
    return {
        "shape": [b, n, t, h],
        "max_abs_difference": float(np.max(np.abs(fused - formula))),
        "within_bf16_tolerance": bool(np.allclose(fused, formula, atol=2e-2, rtol=2e-2)),
    }


def _bench(cfg: Any) -> list[dict[str, Any]]:
    from meshdsl.bench.run import run

    lines: list[str] = []
    summaries = run(cfg, out=lines.append, warn=lines.append)
    keep = (
        "layout",
        "mesh",
        "step_s_median",
        "mfu",
        "memory_bytes_per_device",
        "baseline_jax_step_s",
        "overhead_vs_jax",
        "baseline_note",
        "compile_s",
        "flops_per_step",
    )
    notes = [line for line in lines if "skipped" in line or "dropped" in line]
    return [{"lines": notes}] + [{k: s.get(k) for k in keep} for s in summaries]


def _predictions(preset: str, batch: int, profiles: list[Any]) -> list[dict[str, Any]]:
    """The planner's step time and memory for the 1b step as measured (data_parallel on the devices
    at hand) on each profile; traced once per platform the profiles name."""
    from meshdsl.model.loader import build_model
    from meshdsl.planner.cost import price
    from meshdsl.planner.trace import trace_step
    from meshdsl.runtime.layout_spec import load_layout
    from meshdsl.train import optim

    model = build_model("transformer", preset, batch=batch, compute_dtype="bfloat16")
    layout = load_layout("data_parallel")
    traced: dict[str, Any] = {}
    found = []
    for profile in profiles:
        if profile.platform not in traced:
            sizes = layout.mesh().axis_sizes
            traced[profile.platform] = trace_step(model, optim.make("adamw"), sizes, layout, platform=profile.platform)
        p = price(traced[profile.platform], model, profile)
        found.append({"profile": profile.name, "step_s": p.step_s, "memory_bytes": p.memory.total})
    return found


def gpu_check(out_path: str | Path, dry: bool, out: Callable[[str], None] = print) -> Report:
    """Run every step (see the module docstring) and write the report; the report."""
    from meshdsl.bench.run import BenchConfig
    from meshdsl.planner.profile import default_profile, load_profile

    sizes = DRY if dry else FULL
    report = Report(Path(out_path), dry, deadline=None if dry else time.perf_counter() + TOTAL_S)
    budget = dict.fromkeys(BUDGET_S, 0.0) if dry else BUDGET_S
    folder = report.path.with_suffix("")
    report.step("environment", _environment, out, budget["environment"])
    report.step("fused attention vs XLA", lambda: {"attention": _attention(sizes)}, out, budget["attention"])
    calibrated = report.step(
        "calibrate",
        lambda: {"profile": _calibrate(sizes, folder / "calibrated.json", out)},
        out,
        budget["calibrate"],
    )
    for batch in sizes.batches:
        big = BenchConfig(
            preset=sizes.big_preset,
            layouts=["data_parallel"],
            rounds=sizes.rounds,
            steps_per_round=sizes.steps_per_round,
            baseline="jax",
            out=str(folder / f"batch{batch}"),
            gspmd=False,
            overrides={"batch": batch, "compute_dtype": "bfloat16"},
        )

        def measured_and_predicted(big: Any = big, batch: int = batch) -> dict[str, Any]:
            entries = _bench(big)
            profiles = [load_profile(folder / "calibrated.json")] if calibrated is not None else []
            predictions = _predictions(sizes.big_preset, batch, [*profiles, default_profile()])
            return {"entries": entries, "predictions": predictions}

        title = f"transformer {sizes.big_preset} batch {batch}, bf16, AdamW, vs plain JAX"
        report.step(title, measured_and_predicted, out, budget.get(f"batch {batch}", budget["batch 16"]))
    main = BenchConfig(
        models=[sizes.main_model],
        preset=sizes.main_preset,
        layouts=sizes.main_layouts,
        rounds=sizes.rounds,
        steps_per_round=sizes.steps_per_round,
        out=str(folder / "main"),
        gspmd=False,
    )
    title = f"main job: meshdsl bench --model {sizes.main_model} --preset {sizes.main_preset} --no-gspmd"
    report.step(title, lambda: {"entries": _bench(main)}, out, budget["main job"])
    out(f"meshdsl gpu-check: wrote {report.path} and {_json_path(report.path)}")
    return report


def _calibrate(sizes: Sizes, path: Path, out: Callable[[str], None]) -> dict[str, Any]:
    import jax

    from meshdsl.planner.calibrate import calibrate

    profile, raw = calibrate("gpu-check-" + jax.devices()[0].platform, out, **(sizes.calibrate or {}))
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.save(path, measurements=raw)
    return {
        "matmul_flops": dict(profile.matmul_flops),
        "attention_flops": dict(profile.attention_flops),
        "memory_bandwidth": profile.memory_bandwidth,
        "file": str(path),
    }


def _cell(x: Any, scale: float = 1, spec: str = ".1f", unit: str = "") -> str:
    return "-" if x is None else format(x * scale, spec) + unit


def markdown(steps: list[dict[str, Any]], dry: bool) -> str:
    """The report: the steps' status, then each measurement with the planner's predictions beside it."""
    from meshdsl.measure.fits import readable

    lines = [f"# meshdsl gpu-check{' (dry run: tiny sizes)' if dry else ''}", ""]
    lines += ["| step | seconds | status |", "|---|---|---|"]
    lines += [f"| {s['step']} | {s['seconds']:.1f} | {s['error'] or 'ok'} |" for s in steps]
    for s in steps:
        result = s["result"] or {}
        if s["step"] == "environment" and result:
            lines += ["", f"Device: {result['device']}; JAX {result['jax']}; {result['date']}."]
        if "attention" in result:
            lines += ["", f"Fused attention vs XLA: {json.dumps(result['attention'])}"]
        if "profile" in result:
            lines += ["", f"Calibrated: {json.dumps(result['profile'])}"]
        if "entries" in result:
            predictions = result.get("predictions", [])
            names = [f"predicted ms ({p['profile']}) | predicted memory ({p['profile']})" for p in predictions]
            head = ["layout", "step ms", "MFU", "memory", "plain JAX ms", "÷ jax", *names, "note"]
            columns = sum(len(h.split(" | ")) for h in head)
            lines += ["", f"## {s['step']}", "", "| " + " | ".join(head) + " |", "|" + "---|" * columns]
            for e in result["entries"][1:]:
                memory = (e.get("memory_bytes_per_device") or {}).get("total")
                cells = [
                    e["layout"],
                    _cell(e["step_s_median"], 1e3),
                    _cell(e["mfu"], 100, ".1f", "%"),
                    "-" if memory is None else readable(memory),
                    _cell(e["baseline_jax_step_s"], 1e3),
                    _cell(e["overhead_vs_jax"], 1, ".3f"),
                ]
                cells += [f"{p['step_s'] * 1e3:.1f} | {readable(p['memory_bytes'])}" for p in predictions]
                lines.append("| " + " | ".join([*cells, e["baseline_note"] or ""]) + " |")
            lines += [f"- {line.strip()}" for line in result["entries"][0]["lines"]]
    return "\n".join(lines) + "\n"
