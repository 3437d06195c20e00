"""The benchmark's yardsticks: the plain-JAX baseline runs meshdsl's step, the analytic minimum
follows the rules and dtypes, and the timing order is recorded and reproducible.

Baselines are checked at tiny presets on 4 of the 8 simulated devices; each compiles both steps.
"""

import shutil
from pathlib import Path

import jax
import pytest

import meshdsl as md
from meshdsl.bench import analytic, baselines
from meshdsl.bench.report import frontier
from meshdsl.measure.peaks import peak_flops
from meshdsl.measure.timing import CompiledStep, compile_step, interleaved_rounds, round_orders
from meshdsl.model.loader import build_model
from meshdsl.runtime.layout_spec import load_layout
from meshdsl.train import optim
from meshdsl.train.step import Trainer

LAYOUTS = Path(__file__).resolve().parents[1] / "layouts"
DP_TP = md.Layout("batch:data; heads:model; d_ff:model; vocab:model", mesh_axes={"data": 2, "model": 2})
DATA = md.Layout("batch:data", mesh_axes={"data": 4})


def _step(
    model: str, optimizer: str, layout: md.Layout, grad_reduce_dtype: str | None = None, **overrides
) -> CompiledStep:
    trainer = Trainer(
        build_model(model, "tiny", **overrides),
        optim.make(optimizer),
        layout.mesh(jax.devices()[:4]),
        layout,
        grad_reduce_dtype=grad_reduce_dtype,
    )
    return compile_step(trainer, seed=0)


def _checked(step: CompiledStep) -> baselines.Baseline:
    """The baseline of ``step``, asserting the check ran on copies: both states still at step 0."""
    checked = baselines.baseline(step)
    assert int(step.state["step"]) == 0
    assert checked.step is None or int(checked.step.state[2]) == 0
    return checked


@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "adafactor"])
@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_the_baseline_runs_meshdsls_step(model: str, optimizer: str) -> None:
    """Every shipped model x optimizer: the plain-JAX step's first three losses equal meshdsl's
    (Adafactor as meshdsl defines it, clipping and all), so it is timed."""
    checked = _checked(_step(model, optimizer, DP_TP))
    assert (checked.losses_match, checked.note) == (True, None)
    assert checked.step is not None


def test_the_baseline_follows_the_models_dtype_remat_and_norm() -> None:
    """bf16 compute (whose gradient sums the baseline writes out over the batch shards, as meshdsl
    sums them), remat and LayerNorm: the same losses."""
    step = _step("transformer", "adamw", DATA, compute_dtype="bfloat16", remat=True, norm="layer")
    checked = _checked(step)
    assert (checked.losses_match, checked.note) == (True, None)


def test_the_baseline_sums_gradients_in_grad_reduce_dtype() -> None:
    """bf16 gradient sums: reproduced under data parallelism; under tensor parallelism (where meshdsl
    also sums activation gradients in bf16) no baseline, and the note says why."""
    step = _step("mlp", "adamw", DATA, grad_reduce_dtype="bfloat16")
    checked = _checked(step)
    assert (checked.losses_match, checked.note) == (True, None)
    assert checked.step.losses(3) == pytest.approx(step.losses(3), rel=1e-6)
    tp = _checked(_step("mlp", "adamw", DP_TP, grad_reduce_dtype="bfloat16"))
    assert (tp.step, tp.losses_match) == (None, None)
    assert tp.note.startswith("gradients summed in bfloat16 with d_ff split")


def test_a_baseline_whose_losses_differ_is_not_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A check that fails leaves the baseline untimed, with both loss lists in the note."""
    step = _step("mlp", "sgd", DATA)
    monkeypatch.setattr(
        baselines,
        "_MODELS",
        {
            **baselines._MODELS,
            "mlp": (*baselines._MODELS["mlp"][:2], lambda p, b, c, f: 2 * baselines._mlp_loss(p, b, c, f)),
        },
    )
    checked = baselines.baseline(step)
    assert (checked.step, checked.losses_match) == (None, False)
    assert checked.note.startswith("losses differ, not timed: meshdsl [1.19") and ", plain JAX [2.38" in checked.note


# ---- the analytic minimum ------------------------------------------------------------------------------


def _minimum(
    layout: md.Layout, model: str = "transformer", optimizer: str = "adamw", **overrides
) -> dict[str, float] | None:
    m = build_model(model, "tiny", **overrides)
    return analytic.terms(m, m.init(jax.random.key(0)), layout.mesh(), layout, optim.make(optimizer))


def test_the_minimum_follows_the_rules_not_the_file_name(tmp_path: Path) -> None:
    (tmp_path / "renamed").mkdir()
    (tmp_path / "renamed" / "fsdp.toml").write_text((LAYOUTS / "data_parallel.toml").read_text())
    shutil.copy(LAYOUTS / "fsdp.toml", tmp_path / "zero3.toml")
    fsdp, data_parallel = (
        _minimum(load_layout(str(LAYOUTS / "fsdp.toml"))),
        _minimum(load_layout(str(LAYOUTS / "data_parallel.toml"))),
    )
    assert fsdp["parameter gathers"] > 0 and data_parallel["parameter gathers"] == 0
    assert _minimum(load_layout(str(tmp_path / "zero3.toml"))) == fsdp
    assert _minimum(load_layout(str(tmp_path / "renamed" / "fsdp.toml"))) == data_parallel


def test_bf16_compute_halves_the_activation_terms() -> None:
    megatron = load_layout(str(LAYOUTS / "megatron.toml"))
    f32, bf16 = _minimum(megatron), _minimum(megatron, compute_dtype="bfloat16")
    assert f32["activations"] > 0 and bf16["activations"] == f32["activations"] / 2
    assert {k: v for k, v in bf16.items() if k != "activations"} == {k: v for k, v in f32.items() if k != "activations"}


def test_no_minimum_where_the_formula_has_no_terms() -> None:
    """Adafactor reduces over named dims (collectives of its own); a rule splitting d_model in compute is not
    modelled."""
    assert _minimum(load_layout(str(LAYOUTS / "data_parallel.toml")), optimizer="adafactor") is None
    assert _minimum(md.Layout("batch:data; d_model:model", mesh_axes={"data": 4, "model": 2})) is None


# ---- the timing order ------------------------------------------------------------------------------------


def test_round_orders_are_recorded_permutations_fixed_by_the_seed() -> None:
    orders = round_orders(5, 4, seed=0)
    assert all(sorted(o) == list(range(5)) for o in orders)
    assert len({tuple(o) for o in orders}) == 4  # a fresh order every round
    assert round_orders(5, 4, seed=0) == orders and round_orders(5, 4, seed=1) != orders
    ran: list[int] = []
    interleaved_rounds([lambda i=i: ran.append(i) for i in range(5)], orders, steps_per_round=2)
    assert ran == list(range(5)) + [i for o in orders for i in o for _ in range(2)]  # warm-up, then the recorded orders


def test_the_frontier_keeps_the_layouts_nothing_beats_on_both_memory_and_time() -> None:
    points = [(10, 5), (20, 3), (15, 6), (30, 3), (5, 9), (10, 5)]
    # (15, 6) is beaten by (10, 5), (30, 3) by (20, 3); equal points both stay.
    assert frontier(points) == [4, 0, 5, 1]
    assert frontier([]) == [] and frontier([(1.0, 1.0)]) == [0]


@pytest.mark.parametrize(
    ("kind", "bf16", "f32"),
    [
        # Device kinds as JAX reports them; a name containing another's is matched first.
        ("NVIDIA H100 80GB HBM3", 989e12, 494e12),
        ("NVIDIA H100 PCIe", 756e12, 378e12),
        ("NVIDIA H200", 989e12, 494e12),
        ("NVIDIA GB200", 2.5e15, 1.25e15),
        ("NVIDIA B200", 2.25e15, 1.125e15),
        ("NVIDIA L40S", 362e12, 183e12),
        ("NVIDIA L4", 121e12, 60e12),
        ("TPU v5 lite", 197e12, 197e12),
        ("TPU v5", 459e12, 459e12),
        ("TPU v6 lite", 918e12, 918e12),
    ],
)
def test_peaks_match_the_most_specific_part(kind: str, bf16: float, f32: float) -> None:
    assert (peak_flops(kind, "bfloat16"), peak_flops(kind, "float32")) == (bf16, f32)


def test_no_peak_for_a_cpu() -> None:
    assert peak_flops("cpu", "float32") is None


def test_device_memory_is_the_devices_own_count_where_it_keeps_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from meshdsl.bench import run

    assert run.device_peak_bytes() is None  # XLA's CPU devices keep no count

    class Gpu:
        def memory_stats(self) -> dict:
            return {"bytes_in_use": 10, "peak_bytes_in_use": 12_345, "bytes_limit": 80 * 2**30}

    monkeypatch.setattr(jax, "local_devices", lambda: [Gpu()])
    assert run.device_peak_bytes() == 12_345
    from meshdsl.bench.report import notes

    row = {"baseline_note": None, "round_orders": [[]], "timing_seed": 0, "device_peak_bytes_in_use": 12_345}
    assert "device memory: 12.1 KiB at most in use on the first device over the whole run" in notes([row])


def test_pipelined_entries_say_the_batch_grows_and_the_bubble_is_a_trend() -> None:
    """Issue 33: bench showed measured bubbles of -0.31 and -0.48 with no caveat, and not that the batch grows
    with the microbatch count."""
    from meshdsl.bench.report import notes

    rows = [
        {"baseline_note": None, "round_orders": [[]], "timing_seed": 0, "pipeline": {"microbatches": m}}
        | {"model": "transformer", "layout": f"pipe{m}", "examples_per_step": 4 * m}
        for m in (2, 4)
    ]
    text = notes(rows)
    assert "the batch grows with the microbatch count M (M=2: 8 examples, M=4: 16 examples)" in text
    assert "comes out negative when the timings are noisier than the bubble" in text


def test_gpu_check_dry_runs_every_step_and_writes_one_report(tmp_path: Path) -> None:
    """``meshdsl gpu-check --dry``: every step at tiny sizes on the CPU, each recorded, the transformer
    step timed beside its plain-JAX baseline and the planner's predictions, in markdown and JSON."""
    import json

    from meshdsl.bench.gpu_check import gpu_check
    from meshdsl.cli import main

    assert main(["gpu-check", "--dry", "--out", str(tmp_path)]) == 2  # a folder: one line, nothing run
    (tmp_path / "taken").write_text("a file where the report's folder goes")
    assert main(["gpu-check", "--dry", "--out", str(tmp_path / "taken.md")]) == 2
    assert not (tmp_path / "taken.md").exists()
    lines: list[str] = []
    gpu_check(tmp_path / "check.md", dry=True, out=lines.append)
    data = json.loads((tmp_path / "check.json").read_text())
    steps = {s["step"]: s for s in data["steps"]}
    assert data["dry"] and [s["error"] for s in data["steps"]] == [None] * 5, data["steps"]
    assert steps["fused attention vs XLA"]["result"]["attention"] == {"skipped": "no GPU: only XLA's formula runs here"}
    big = steps["transformer tiny batch 8, bf16, AdamW, vs plain JAX"]["result"]
    entry = big["entries"][1]
    assert entry["baseline_note"] is None and entry["baseline_jax_step_s"] > 0 and entry["step_s_median"] > 0
    assert [p["profile"] for p in big["predictions"]] == ["gpu-check-cpu", "cpu-sim"]
    calibrated = json.loads((tmp_path / "check" / "calibrated.json").read_text())
    assert calibrated["name"] == "gpu-check-cpu" and set(calibrated["attention_flops"]) == {"float32", "bfloat16"}
    text = (tmp_path / "check.md").read_text()
    row = f"| data_parallel | {entry['step_s_median'] * 1e3:.1f} | - |"
    assert row in text and f"{big['predictions'][1]['step_s'] * 1e3:.1f}" in text
    assert "1000000.00" not in "\n".join(lines) + text  # issue 33: placeholder rates were printed as figures


def test_gpu_check_skips_a_step_its_budget_no_longer_covers(tmp_path: Path) -> None:
    """With less of the run's budget left than a step is budgeted, the step is recorded as skipped, not run."""
    import re
    import time

    from meshdsl.bench.gpu_check import Report

    report = Report(tmp_path / "r.md", dry=False, deadline=time.perf_counter() + 10)
    ran: list[str] = []
    assert report.step("quick", lambda: ran.append("quick") or {}, ran.append, budget=1) == {}
    assert report.step("long", lambda: ran.append("long") or {}, ran.append, budget=60) is None
    assert "long" not in ran
    assert re.fullmatch(r"skipped: \d+ s of the run's 450 s left, the step is budgeted 60 s", report.steps[1]["error"])
    assert "| long | 0.0 | skipped: " in (tmp_path / "r.md").read_text()
