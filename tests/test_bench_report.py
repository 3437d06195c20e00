"""The benchmark's report from summaries alone (nothing compiled): the verdict, the legend, the results
folder, and charts a person reads at a glance with 4 or 20 entries."""

import dataclasses
import io
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import meshdsl as md
from meshdsl.bench import report
from meshdsl.bench.run import BenchConfig, _layout_warnings, model_settings, results_dir
from meshdsl.errors import ConfigError
from meshdsl.measure import fits
from meshdsl.model.loader import build_model
from meshdsl.planner.calibrate import fit, link_line
from meshdsl.planner.profile import load_profile
from meshdsl.planner.search import Candidate, Dropped, _no_fit, search, write_layout
from meshdsl.runtime.waiting import Waiting
from meshdsl.train import optim
from meshdsl.train.loop import RunConfig
from meshdsl.train.loop import _model as train_model
from meshdsl.train.resolve import settle
from meshdsl.train.rules import split_warnings

MIB = 2**20


def fake(
    layout: str, median_ms: float, p25_ms: float, p75_ms: float, mem_mib: float, kinds: dict[str, float], **extra: Any
) -> dict[str, Any]:
    """A summary as ``Entry.summary()`` gives it, with the figures the report reads."""
    moved = sum(kinds.values()) * MIB
    return {
        "model": "transformer",
        "preset": "small",
        "layout": layout,
        "mesh": "data=8",
        "devices": 8,
        "compile_s": 1.0,
        "step_s_median": median_ms / 1e3,
        "step_s_spread": (p75_ms - p25_ms) / 1e3,
        "step_s_p25": p25_ms / 1e3,
        "step_s_p75": p75_ms / 1e3,
        "examples_per_step": 8,
        "tokens_per_s": 1000.0,
        "flops_per_s": None,
        "mfu": None,
        "memory_bytes_per_device": {"total": mem_mib * MIB, "temporaries": MIB},
        "collectives_measured": {k: {"count": 1, "bytes": b * MIB} for k, b in kinds.items()},
        "collective_count": len(kinds),
        "collective_bytes_per_device": moved,
        "predicted_bytes_per_device": moved,
        "predicted_bytes_per_device_on_accelerator": moved,
        "bytes_match_prediction": True,
        "bytes_over_minimum": 1.0,
        "bytes_over_gspmd": 1.0,
        "collectives_gspmd": {},
        "gspmd_note": None,
        "overhead_vs_jax": None,
        "baseline_note": None,
        "baseline_losses_match": None,
        "timing_seed": 0,
        "round_orders": [[]],
        "pipeline": None,
        **extra,
    }


FOUR = [
    fake("data_parallel", 400, 380, 900, 300, {"all-reduce": 40}),
    fake("megatron", 500, 450, 560, 200, {"all-reduce": 10, "all-gather": 30}),
    fake("dp_tp", 325, 300, 340, 250, {"all-reduce": 20, "all-gather": 5}),
    fake("fsdp", 600, 590, 610, 120, {"all-gather": 60, "reduce-scatter": 20}),
]


def test_the_verdict_names_the_winner_its_margin_and_spread_the_leanest_and_why() -> None:
    text = report.verdict(FOUR)
    lines = text.splitlines()
    assert lines[0] == "verdict (preset small, 8 devices, median step time over the rounds):"
    assert lines[1] == (
        "transformer: fastest dp_tp, 325.0 ms (IQR 300.0-340.0 ms), 23% ahead of data_parallel (400.0 ms, IQR "
        "380.0-900.0 ms)"
    )
    assert lines[2] == "  least memory per device: fsdp, 120 MiB (compiled)"
    assert lines[3] == (
        "  why: dp_tp moves 25 MiB per device per step, 80% all-reduce, less than data_parallel's 40 MiB: "
        "communication decides."
    )


def test_the_verdict_says_compute_bound_and_within_the_noise() -> None:
    rows = [fake("a", 100, 90, 130, 10, {"all-reduce": 50}), fake("b", 110, 95, 120, 10, {"all-reduce": 5})]
    text = report.verdict(rows)
    assert "the ranges overlap, so the lead is within the noise" in text
    assert "compute-bound" in text and "no less than b's 5 MiB" in text


def test_pipelined_variants_with_different_batches_are_ranked_per_example() -> None:
    rows = [fake("p[1f1b M=2]", 100, 90, 110, 10, {}, examples_per_step=8)]
    rows.append(fake("p[1f1b M=8]", 300, 290, 310, 10, {}, examples_per_step=32))
    text = report.verdict(rows)
    assert "ranked by time per example" in text and "fastest p[1f1b M=8]" in text


def test_the_legend_explains_every_column_and_every_dash() -> None:
    rows = [
        *FOUR[:2],
        fake("gpipe", 700, 650, 720, 90, {}, bytes_over_minimum=None, collectives_gspmd=None, bytes_over_gspmd=None),
    ]
    rows[-1]["gspmd_note"] = "XLA's partitioner does not pipeline"
    key = report.legend(rows)
    for column in report.COLUMNS:
        assert f"  {column.name}: " in key
    assert "tokens per second" in key and "interquartile range, 25th to 75th percentile" in key
    assert "÷ jax: no plain-JAX baseline asked for (--baseline jax) (data_parallel, megatron, gpipe)" in key
    assert "÷ gspmd: XLA's partitioner does not pipeline (gpipe)" in key
    assert "÷ minimum: no analytic minimum" in key and "bubble theory/ticks/measured: not pipelined" in key
    assert "920.0 (380.0-900.0)" not in report.table(rows) and "400.0 (380.0-900.0)" in report.table(rows)


def test_the_screen_ends_with_the_verdict_and_results_md_opens_with_it(tmp_path: Path) -> None:
    shown = report.write_reports(FOUR, tmp_path)
    assert shown.endswith(report.verdict(FOUR))
    assert f"results in {tmp_path}/: results.json, results.md, step_time.png" in shown
    assert (tmp_path / "results.md").read_text().startswith("```\n" + report.verdict(FOUR))


def test_each_run_gets_a_new_folder_and_an_old_one_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert results_dir(BenchConfig()) == Path("bench-results/run-1")
    report.write_reports([], results_dir(BenchConfig()))
    assert results_dir(BenchConfig()) == Path("bench-results/run-2")
    with pytest.raises(ConfigError, match=r"--out 'bench-results/run-1' holds an earlier run's results .* --force"):
        results_dir(BenchConfig(out="bench-results/run-1"))
    assert results_dir(BenchConfig(out="bench-results/run-1", force=True)) == Path("bench-results/run-1")


def _drawn(monkeypatch: pytest.MonkeyPatch, rows: list[dict[str, Any]], tmp_path: Path) -> dict[str, Any]:
    """Each chart's figure and axes, by file name, as saved (drawn, so labels have their extents)."""
    saved: dict[str, Any] = {}
    real = report._save

    def keep(plt: Any, fig: Any, ax: Any, title: str, path: Path, legend: int | None = None) -> Path:
        fig.canvas.draw()
        saved[path.name] = (fig, ax)
        return real(plt, fig, ax, title, path, legend)

    monkeypatch.setattr(report, "_save", keep)
    report.write_reports(rows, tmp_path)
    return saved


@pytest.mark.parametrize("n", [4, 20])
def test_charts_have_true_iqr_whiskers_zero_axes_and_labels_apart(
    n: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    rows = [{**FOUR[i % 4], "layout": f"{FOUR[i % 4]['layout']}_{i}_long_name"} for i in range(n)]
    saved = _drawn(monkeypatch, rows, tmp_path)
    fig, ax = saved["step_time.png"]
    whiskers = [seg for coll in ax.collections for seg in coll.get_segments()]
    spans = sorted((round(float(s[0][0]), 3), round(float(s[1][0]), 3)) for s in whiskers)
    assert spans == sorted((r["step_s_p25"] * 1e3, r["step_s_p75"] * 1e3) for r in rows)
    for name in ["step_time.png", "bytes.png", "bytes_by_kind.png", "time_memory.png"]:
        fig, ax = saved[name]
        assert ax.get_xlim()[0] == 0, name
        values = [p.get_x() + p.get_width() for p in ax.patches]
        assert not values or max(values) < ax.get_xlim()[1], name  # the tallest bar is not clipped
        boxes = [t.get_window_extent() for t in ax.get_yticklabels() if t.get_text()]
        assert all(not a.overlaps(b) for a, b in zip(boxes, boxes[1:])), name
    assert saved["time_memory.png"][1].get_ylim()[0] == 0


def test_waiting_prints_the_first_the_last_and_one_line_per_interval_with_an_eta() -> None:
    now = [0.0]
    out = io.StringIO()
    wait = Waiting(
        "meshdsl search", "candidates traced and priced", 40, every=2.0, out=out, clock=lambda: now[0], live=True
    )
    wait.show()
    for _ in range(40):
        now[0] += 0.25  # 10 s in all: the first line, one every 2 s, the last at 10 s
        wait.advance()
    lines = out.getvalue().splitlines()
    assert len(lines) == 6
    assert lines[0] == "meshdsl search: 0/40 candidates traced and priced, 0:00 elapsed"
    assert lines[1] == "meshdsl search: 8/40 candidates traced and priced, 0:02 elapsed, ETA 0:08"
    assert lines[-1] == "meshdsl search: 40/40 candidates traced and priced, 0:10 elapsed, ETA 0:00"


def test_bench_warns_of_a_shipped_layout_that_splits_nothing_and_names_an_empty_one() -> None:
    model = build_model("transformer", "tiny")
    (warning,) = _layout_warnings("spatial", model, "transformer")
    assert warning.startswith("layout ") and "splits no dim of model transformer" in warning
    (empty,) = split_warnings(md.Layout(""), md.Mesh({"data": 8}), model, "transformer")
    assert empty.startswith("layout no rules (everything replicated) splits no dim of model transformer")


def test_search_reports_its_progress_and_is_quiet_off_a_terminal() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    shown, log = Terminal(), io.StringIO()
    model = build_model("mlp", "tiny")
    result = search(model, optim.make("adamw"), 8, load_profile("cpu-sim"), None, pipeline=False, status=shown)
    search(model, optim.make("adamw"), 8, load_profile("cpu-sim"), None, pipeline=False, status=log)
    lines = shown.getvalue().splitlines()
    total = len(result.ranked) + len(result.dropped)
    assert lines[0].startswith("meshdsl search: tracing the model's state, batch and step")
    assert re.match(rf"meshdsl search: \d+/{total} candidates traced and priced \(next: \[", lines[1]), lines[1]
    assert lines[-1].startswith(f"meshdsl search: {total}/{total} candidates traced and priced, ")
    assert log.getvalue() == ""


def test_calibrate_names_an_unresolved_bandwidth_instead_of_a_placeholder_figure() -> None:
    flat = fit([(1024, 1e-5), (4096, 1e-5), (16384, 0.9e-5)])  # a dry run: the time does not grow with the bytes
    assert "bandwidth not resolved" in link_line("all-gather", flat) and "GB/s" not in link_line("all-gather", flat)
    assert link_line("all-gather", fit([(0, 1e-5), (10**9, 1e-5 + 0.01)])).endswith("100.00 GB/s per device")


def test_remedies_do_not_suggest_remat_to_a_model_that_recomputes_already() -> None:
    cap = fits.Capacity(80 * 10**9, "h100")
    on, off = build_model("transformer", "tiny", remat=True), build_model("transformer", "tiny")
    assert fits.remats(on) and not fits.remats(off)
    assert "--set remat=true" in fits.remedies(cap) and "--set remat=true" not in fits.remedies(cap, fits.remats(on))
    over = [Dropped(Candidate({"data": 8}, md.Layout("batch:data")), "over", 90 * 2**30)]
    assert "--set remat=true" in _no_fit("transformer", 8, 80 * 2**30, over)
    assert "--set remat=true" not in _no_fit("transformer", 8, 80 * 2**30, over, remat=True)


def test_the_layout_search_writes_records_what_it_assumed_and_train_and_bench_apply_it(tmp_path: Path) -> None:
    model = build_model("transformer", "tiny", remat=True)
    path = tmp_path / "best.toml"
    candidate = Candidate({"data": 8}, md.Layout("batch:data", mesh_axes={"data": 8}))
    predicted = SimpleNamespace(step_s=0.1, memory=SimpleNamespace(total=2**30), total_bytes=2**20)
    write_layout(candidate, predicted, path, load_profile("cpu-sim"), model)
    assert 'remat = true\ncompute_dtype = "float32"' in path.read_text()
    assert md.Layout.load(path).rules == {"batch": ("data",)}
    run = settle(RunConfig(model="transformer", preset="tiny", layout=str(path))).run
    assert run.remat is True and run.compute_dtype == "float32"
    assert train_model(run).config.remat is True
    assert train_model(dataclasses.replace(run, overrides={"remat": False})).config.remat is False  # --set wins
    assert model_settings(str(path)) == {"remat": True, "compute_dtype": "float32"}
    assert model_settings("batch:data") == {}


def test_a_resume_at_its_last_step_says_nothing_to_train_before_compiling(tmp_path: Path, capsys) -> None:
    from meshdsl.cli import main

    args = ["train", "--model", "mlp", "--preset", "tiny", "--steps", "2", "--save-every", "2"]
    args += ["--checkpoint-dir", str(tmp_path / "ckpt")]
    assert main(args) == 0
    capsys.readouterr()
    assert main([*args, "--resume"]) == 0
    out = capsys.readouterr().out
    assert "nothing to train: the checkpoint is at step 2, which is --steps (nothing compiled)" in out
    assert "compiling" not in out


def test_meshdsls_own_files_are_not_credited_as_the_users_line() -> None:
    import importlib

    from meshdsl.analysis.user_lines import _rank

    compile_py = importlib.import_module("meshdsl.compile").__file__
    spmd_py = importlib.import_module("meshdsl.lowering.spmd").__file__
    assert _rank(compile_py) == (1, "meshdsl/compile.py")  # below any user line (rank 0)
    assert _rank(spmd_py)[0] == 2
    assert _rank("/home/me/first_program.py")[0] == 0
