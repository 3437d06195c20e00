"""The ``meshdsl`` command as a user runs it (a subprocess), the benchmark's report, and token files."""

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import harness
import jax
import numpy as np
import pytest
from meshdsl.models import transformer

import meshdsl as md
from meshdsl.bench.run import BenchConfig, run
from meshdsl.model.loader import build_model
from meshdsl.train import optim
from meshdsl.train.step import Trainer

ROOT = Path(__file__).resolve().parents[1]


def meshdsl(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "meshdsl.cli", *args],
        cwd=cwd,
        env=harness.subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_train_runs_and_learns_as_a_user_runs_it(tmp_path):
    result = meshdsl(
        "train", "--model", "transformer", "--preset", "tiny", "--layout", "dp_tp", "--steps", "12", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert "on mesh data=4 model=2 (cpu)" in result.stdout
    losses = [float(line.split("loss ")[1].split()[0]) for line in result.stdout.splitlines() if " loss " in line]
    assert len(losses) >= 2 and losses[-1] < losses[0]


def test_train_reports_user_mistakes_without_a_traceback(tmp_path):
    missing = meshdsl(
        "train", "--model", "mlp", "--preset", "tiny", "--layout", "nowhere.toml", "--steps", "1", cwd=tmp_path
    )
    assert missing.returncode == 2 and "layout file 'nowhere.toml' not found" in missing.stderr
    assert "Traceback" not in missing.stderr
    misfit = meshdsl(
        "train", "--model", "transformer", "--preset", "tiny", "--layout", "d_kv:data", "--steps", "1", cwd=tmp_path
    )
    assert misfit.returncode == 2 and "Traceback" not in misfit.stderr
    assert "dim d_kv (size 4)" in misfit.stderr and "data (size 8)" in misfit.stderr
    preset = meshdsl("train", "--model", "mlp", "--preset", "huge", "--steps", "1", cwd=tmp_path)
    assert preset.returncode == 2 and "unknown preset 'huge'" in preset.stderr
    no_devices = meshdsl("--devices", "0", "train", "--model", "mlp", "--preset", "tiny", "--steps", "1", cwd=tmp_path)
    assert no_devices.returncode == 2 and "Traceback" not in no_devices.stderr
    assert "--devices 0: simulate at least 1 device" in no_devices.stderr


def test_bench_command_writes_every_report(tmp_path):
    result = meshdsl(
        "bench",
        "--model",
        "mlp",
        "--preset",
        "tiny",
        "--rounds",
        "2",
        "--steps-per-round",
        "1",
        "--baseline",
        "jax",
        "--no-gspmd",  # its column is test_bench_times_a_baseline_only_where_it_runs_meshdsls_step's
        "--out",
        str(tmp_path / "out"),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    for name in ["results.json", "results.md", "step_time.png", "bytes.png", "time_memory.png", "bytes_by_kind.png"]:
        assert (tmp_path / "out" / name).stat().st_size > 0
    rows = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["layout"] for r in rows] == ["data_parallel", "megatron", "dp_tp", "fsdp"]
    assert all(r["overhead_vs_jax"] > 0 for r in rows)


FIELDS = {
    "model",
    "preset",
    "layout",
    "mesh",
    "devices",
    "compile_s",
    "step_s_median",
    "step_s_spread",
    "step_times_s",
    "tokens_per_s",
    "flops_per_step",
    "flops_per_s",
    "mfu",
    "memory_bytes_per_device",
    "collectives_measured",
    "collectives_predicted",
    "collective_count",
    "collective_bytes_per_device",
    "predicted_bytes_per_device",
    "predicted_bytes_per_device_on_accelerator",
    "bytes_match_prediction",
    "analytic_minimum_bytes",
    "bytes_over_minimum",
    "baseline_jax_step_s",
    "overhead_vs_jax",
    "baseline_losses_match",
    "baseline_note",
    "timing_seed",
    "round_orders",
}


@pytest.fixture(scope="module")
def transformer_rows(tmp_path_factory) -> list[dict]:
    """``meshdsl bench``'s rows for the tiny Transformer under the four default layouts (run once). Without the
    gspmd compile of each step (``--no-gspmd``): no test reading these rows reads its figures, and
    test_bench_times_a_baseline_only_where_it_runs_meshdsls_step checks them."""
    out = tmp_path_factory.mktemp("bench")
    return run(
        BenchConfig(models=["transformer"], preset="tiny", rounds=2, steps_per_round=1, out=str(out), gspmd=False),
        out=lambda s: None,
    )


def test_bench_measures_what_explain_predicts(transformer_rows):
    rows = transformer_rows
    assert {r["layout"] for r in rows} == {"data_parallel", "megatron", "dp_tp", "fsdp"}
    for r in rows:
        assert FIELDS <= set(r), FIELDS - set(r)
        assert r["collectives_measured"] == r["collectives_predicted"], r["layout"]
        assert r["bytes_over_minimum"] == pytest.approx(1.0), r["layout"]
        assert r["mfu"] is None  # CPU: no known peak
        assert r["memory_bytes_per_device"]["total"] > 0 and len(r["step_times_s"]) == 2
    by = {r["layout"]: r for r in rows}
    # fsdp stores parameters split: less memory than data parallel; it moves data parallel's bytes
    # (gather + reduce-scatter = all-reduce) plus a second gather of each layer's parameters.
    assert (
        by["fsdp"]["memory_bytes_per_device"]["arguments"] < by["data_parallel"]["memory_bytes_per_device"]["arguments"]
    )
    c = transformer.Config.preset("tiny")
    per_layer = c.d_model * 3 * c.heads * c.d_kv + c.heads * c.d_kv * c.d_model + 2 * c.d_model * c.d_ff + 2 * c.d_model
    extra = by["fsdp"]["collective_bytes_per_device"] - by["data_parallel"]["collective_bytes_per_device"]
    assert extra == pytest.approx(4 * c.layers * per_layer * 7 / 8, rel=1e-3)


def test_bench_times_a_baseline_only_where_it_runs_meshdsls_step(tmp_path):
    """A pipelined entry gets no baseline (null time, a note); the data-parallel one is checked and
    timed. Every row records the seed and each round's order of the three steps timed."""
    cfg = BenchConfig(
        models=["transformer"],
        preset="tiny",
        layouts=["gpipe", "data_parallel"],
        rounds=3,
        steps_per_round=1,
        baseline="jax",
        seed=7,
        out=str(tmp_path),
    )
    lines: list[str] = []
    pipelined, data_parallel = run(cfg, out=lines.append)
    assert (pipelined["baseline_jax_step_s"], pipelined["baseline_losses_match"], pipelined["overhead_vs_jax"]) == (
        None,
        None,
        None,
    )
    assert pipelined["baseline_note"] == "pipelined (gpipe, 4 microbatches): plain JAX has no version of the schedule"
    assert data_parallel["baseline_losses_match"] is True and data_parallel["baseline_note"] is None
    assert data_parallel["baseline_jax_step_s"] > 0 and len(data_parallel["baseline_jax_step_times_s"]) == 3
    timed = {"transformer x gpipe[gpipe M=4]", "transformer x data_parallel", "transformer x data_parallel (plain JAX)"}
    for row in (pipelined, data_parallel):
        assert row["timing_seed"] == 7 and len(row["round_orders"]) == 3
        assert all(sorted(order) == sorted(timed) for order in row["round_orders"])
    assert pipelined["round_orders"] == data_parallel["round_orders"]
    note = "transformer x gpipe[gpipe M=4]: plain-JAX baseline not timed: pipelined"
    assert note in (tmp_path / "results.md").read_text() and any(note in line for line in lines)
    # XLA's partitioner beside meshdsl: no gspmd figure for the pipelined step (it cannot pipeline);
    # for data parallel, at least every parameter's gradient all-reduced over 8 devices.
    assert (pipelined["gspmd_bytes_per_device"], pipelined["bytes_over_gspmd"]) == (None, None)
    assert pipelined["gspmd_note"].startswith("XLA's partitioner does not pipeline")
    trainer = Trainer(
        build_model("transformer", "tiny"), optim.make("adamw"), md.Mesh("data=8"), md.Layout("batch:data")
    )
    params = sum(leaf.size for leaf in jax.tree_util.tree_leaves(trainer.abstract_state()["params"]))
    gspmd = data_parallel["gspmd_bytes_per_device"]
    assert gspmd >= 2 * 7 / 8 * 4 * params and data_parallel["gspmd_note"] is None
    assert data_parallel["collectives_gspmd"]["all-reduce"]["bytes"] >= 2 * 7 / 8 * 4 * params
    assert data_parallel["bytes_over_gspmd"] == pytest.approx(data_parallel["collective_bytes_per_device"] / gspmd)
    assert (tmp_path / "bubble.png").stat().st_size > 0
    assert (
        "÷ gspmd" in lines[-1] and "gspmd: XLA's partitioner does not pipeline" in (tmp_path / "results.md").read_text()
    )


def _affine_tokens(n: int, vocab: int) -> np.ndarray:
    out = np.zeros(n, np.uint16)
    for i in range(1, n):
        out[i] = (5 * int(out[i - 1]) + 3) % vocab
    return out


def test_training_on_a_token_file_learns(tmp_path):
    np.save(tmp_path / "tokens.npy", _affine_tokens(20000, 64).astype(np.int32))
    result = meshdsl(
        "train",
        "--model",
        "transformer",
        "--preset",
        "tiny",
        "--layout",
        "data_parallel",
        "--data",
        str(tmp_path / "tokens.npy"),
        "--steps",
        "15",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    losses = [float(line.split("loss ")[1].split()[0]) for line in result.stdout.splitlines() if " loss " in line]
    assert losses[-1] < 0.8 * losses[0]


def test_bench_shows_bf16_gradient_reduction_halving_the_bytes(tmp_path, transformer_rows):
    """The gradient all-reduce in bf16 moves half the bytes on an accelerator; XLA on CPU widens it
    to f32, so the CPU's HLO moves what f32 does, and the bench reports both."""
    (f32,) = [r for r in transformer_rows if r["layout"] == "data_parallel"]
    cfg = BenchConfig(
        models=["transformer"],
        preset="tiny",
        layouts=["data_parallel"],
        rounds=1,
        steps_per_round=1,
        out=str(tmp_path),
        grad_reduce_dtype="bfloat16",
        gspmd=False,  # the gspmd figures are not what this test reads
    )
    (bf16,) = run(cfg, out=lambda s: None)
    loss = 2 * 7 / 8 * 4  # the f32 loss all-reduce, the one sum left in f32
    assert f32["predicted_bytes_per_device_on_accelerator"] == f32["collective_bytes_per_device"]
    assert bf16["collective_bytes_per_device"] == f32["collective_bytes_per_device"]
    assert bf16["predicted_bytes_per_device_on_accelerator"] == pytest.approx(
        (f32["collective_bytes_per_device"] - loss) / 2 + loss
    )
    # the minimum prices the gradient sums in bf16 too; the step's accelerator bytes meet it
    assert bf16["analytic_minimum_bytes"] == pytest.approx((f32["analytic_minimum_bytes"] - loss) / 2 + loss)
    assert f32["bytes_over_minimum"] == pytest.approx(1.0) and bf16["bytes_over_minimum"] == pytest.approx(1.0)
    assert "(accel. " in (tmp_path / "results.md").read_text()


def test_bf16_gradient_reduction_trains():
    """``--grad-reduce-dtype bfloat16``: gradients are summed in bf16 (XLA on CPU widens them to f32)."""
    import meshdsl.models.transformer as transformer

    from meshdsl.train import optim
    from meshdsl.train.step import Trainer

    layout = md.Layout.load(ROOT / "layouts" / "data_parallel.toml")
    model = transformer.Model(transformer.Config.preset("tiny"))
    trainer = Trainer(model, optim.adamw(1e-2), layout.mesh(), layout, grad_reduce_dtype="bfloat16")
    state = trainer.init(jax.random.key_data(jax.random.key(0)))
    key = jax.random.key_data(jax.random.key(1))
    jaxpr = str(jax.make_jaxpr(trainer.step.spmd_function)(state, key))
    # Every gradient sum is in bf16; the one f32 sum left is the loss.
    assert len(re.findall(r"bf16\[[\d,]*\] = psum", jaxpr)) == 9
    assert len(re.findall(r"f32\[[\d,]*\] = psum", jaxpr)) == 1
    losses = []
    for _ in range(10):
        state, loss = trainer.step(state, key)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]


# ---- models of the user's: a file or an importable module, in every command -------------------------------

MODEL = """
import dataclasses

import jax

import meshdsl as md


@dataclasses.dataclass(frozen=True)
class Config:
    rows: int = 16
    cols: int = 8
    units: int = 32

    PRESETS = {"tiny": {}, "big": dict(rows=64, units=128)}


class Model:
    def __init__(self, config):
        self.config = config
        self.rows, self.cols, self.units = (md.Dim(n, getattr(config, n)) for n in ("rows", "cols", "units"))

    def init(self, key):
        k1, k2 = jax.random.split(key)
        return {"a": md.random.normal(k1, [self.cols, self.units]), "b": md.random.normal(k2, [self.units, self.cols])}

    def batch(self, key):
        x = md.random.normal(key, [self.rows, self.cols])
        return {"x": x, "y": md.square(x)}

    def loss(self, params, batch):
        h = md.relu(md.einsum(batch["x"], params["a"], out=[self.rows, self.units]))
        return md.reduce_mean(md.square(md.einsum(h, params["b"], out=[self.rows, self.cols]) - batch["y"]))
"""

BROKEN = {
    "syntax.py": "def broken(:\n    pass\n",
    "raises.py": "import dataclasses\n\nvalue = undefined_name + 1\n",
    "needs.py": "import nonexistent_dependency_xyz\n",
    "no_config.py": "class Model:\n    pass\n",
    "not_dataclass.py": "class Config:\n    PRESETS = {'tiny': {}}\n\n\nclass Model:\n    pass\n",
    "no_presets.py": "import dataclasses\n\n\n@dataclasses.dataclass\nclass Config:\n    rows: int = 4\n\n\nclass "
    "Model:\n    pass\n",
    "no_loss.py": MODEL.replace("    def loss(self, params, batch):", "    def lost(self, params, batch):"),
    "notes.txt": "not a model\n",
}


@pytest.fixture
def models_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working folder holding a good model file, broken ones, and a package ``userpkg`` on sys.path."""
    (tmp_path / "good.py").write_text(MODEL)
    for name, text in BROKEN.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "adir").mkdir()
    (tmp_path / "userpkg").mkdir()
    (tmp_path / "userpkg" / "__init__.py").write_text("")
    (tmp_path / "userpkg" / "model.py").write_text(MODEL)
    (tmp_path / "userpkg" / "broken.py").write_text("import dataclasses\nraise RuntimeError('bad weights file')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "userpkg" or m.startswith("userpkg.")]:
        monkeypatch.delitem(sys.modules, name)  # an earlier test's userpkg lives in another folder
    return tmp_path


TINY = ["--preset", "tiny"]
MODEL_MISTAKES = {
    "file not found": (["--model", "missing.py", *TINY], ["--model 'missing.py': file not found"]),
    "not a python file": (["--model", "notes.txt", *TINY], ["--model 'notes.txt' is not a Python file"]),
    "a directory": (["--model", "adir", *TINY], ["--model 'adir' is a directory"]),
    "syntax error": (
        ["--model", "syntax.py", *TINY],
        ["importing it failed at", "syntax.py:1 (`def broken(:`): SyntaxError"],
    ),
    "error in the module": (
        ["--model", "raises.py", *TINY],
        ["raises.py:3 (`value = undefined_name + 1`): NameError: name 'undefined_name' is not defined"],
    ),
    "missing dependency": (
        ["--model", "needs.py", *TINY],
        [
            "needs.py:1 (`import nonexistent_dependency_xyz`): ModuleNotFoundError: No module named "
            "'nonexistent_dependency_xyz'"
        ],
    ),
    "no Config": (["--model", "no_config.py", *TINY], ["model no_config.py has no Config:", "PRESETS"]),
    "Config not a dataclass": (["--model", "not_dataclass.py", *TINY], ["Config is not a dataclass"]),
    "no PRESETS": (["--model", "no_presets.py", *TINY], ["Config.PRESETS must be a non-empty dict", "got None"]),
    "Model without loss": (["--model", "no_loss.py", *TINY], ["Model has no loss"]),
    "unknown preset": (
        ["--model", "good.py", "--preset", "huge"],
        ["unknown preset 'huge' for good.py; choose one of tiny, big"],
    ),
    "unknown --set field": (
        ["--model", "good.py", *TINY, "--set", "depth=3"],
        ["model good.py has no option depth; its fields are rows, cols, units"],
    ),
    "--set of the wrong type": (
        ["--model", "good.py", *TINY, "--set", "units=wide"],
        ["model good.py: units='wide'", "integer of at least 1"],
    ),
    "unknown module": (
        ["--model", "nosuchpkg.model", *TINY],
        ["unknown model 'nosuchpkg.model'", "a Python file (path/to/model.py)"],
    ),
    "module that fails to import": (
        ["--model", "userpkg.broken", *TINY],
        ["userpkg/broken.py:2 (`raise RuntimeError('bad weights file')`): RuntimeError: bad weights file"],
    ),
}
COMMANDS = {
    "train": ["train", "--steps", "1"],
    "bench": ["bench", "--rounds", "1"],
    "explain": ["explain", "--no-compile"],
    "generate": ["generate", "--prompt-ids", "1"],
    "search": ["search", "--profile", "cpu-sim"],
    "launch train": ["launch", "--local", "2", "--", "train"],
}


def _error(argv: list[str], capsys) -> str:
    """The one error line ``meshdsl argv`` prints (exit status 2, nothing on stdout, no traceback)."""
    from meshdsl.cli import main

    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and "Traceback" not in err, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("args, expected", list(MODEL_MISTAKES.values()), ids=list(MODEL_MISTAKES))
def test_a_mistake_in_a_users_model_is_one_line(args: list[str], expected: list[str], models_dir: Path, capsys) -> None:
    line = _error(["train", "--steps", "1", *args], capsys)
    assert line.startswith("meshdsl train: error: "), line
    for text in expected:
        assert text in line, (text, line)


@pytest.mark.parametrize("command", list(COMMANDS.values()), ids=list(COMMANDS))
def test_every_command_loads_models_the_same_way(command: list[str], models_dir: Path, capsys) -> None:
    for args, expected in (MODEL_MISTAKES["unknown preset"], MODEL_MISTAKES["error in the module"]):
        line = _error([*command, *args], capsys)
        assert all(text in line for text in expected), line


def test_set_overrides_a_field_in_every_command(models_dir: Path) -> None:
    from meshdsl.cli import _config, _parser
    from meshdsl.model.loader import build_model

    for command in COMMANDS.values():
        argv = [*command, "--model", "good.py", *TINY, "--set", "units=48", "--set", "rows=8"]
        if command[0] == "launch":
            argv = argv[argv.index("--") + 1 :]
        config = _config(_parser().parse_args(argv))
        overrides = getattr(config, "overrides", config)
        assert overrides == {"units": 48, "rows": 8}, argv
        assert build_model("good.py", "tiny", **overrides).config == build_model("good.py", "tiny").config.__class__(
            rows=8, cols=8, units=48
        )


def test_an_importable_module_is_a_model(models_dir: Path, capsys) -> None:
    from meshdsl.cli import main

    assert (
        main(
            [
                "explain",
                "--model",
                "userpkg.model",
                *TINY,
                "--layout",
                "rows:data",
                "--no-compile",
                "--profile",
                "cpu-sim",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "meshdsl explain: userpkg.model tiny on mesh data=8" in printed and "all-reduce" in printed


def test_optional_parts_missing_are_named_in_one_line(models_dir: Path, capsys) -> None:
    """A model without flops_per_step, examples_per_step and LAYOUTS: bench and train say what they
    leave out, and bench needs --layouts."""
    import io

    from meshdsl.train.loop import RunConfig, train

    line = _error(["bench", "--model", "good.py", *TINY, "--rounds", "1"], capsys)
    assert "model good.py lists no LAYOUTS (the layouts bench runs by default); name them, e.g. --layouts" in line
    warned: list[str] = []
    (row,) = run(
        BenchConfig(
            models=["good.py"],
            preset="tiny",
            layouts=["rows:data"],
            rounds=1,
            steps_per_round=1,
            out=str(models_dir / "out"),
        ),
        out=lambda s: None,
        warn=warned.append,
    )
    assert warned == [
        "meshdsl bench: note: model good.py has no flops_per_step(), so no FLOP/s or MFU is reported",
        "meshdsl bench: note: model good.py has no examples_per_step(), so no throughput is reported",
    ]
    assert (
        row["layout"] == "rows:data"
        and row["flops_per_s"] is None
        and row["mfu"] is None
        and row["examples_per_s"] is None
    )
    assert row["collectives_measured"] == row["collectives_predicted"]
    out, err = io.StringIO(), io.StringIO()
    losses = train(RunConfig(model="good.py", preset="tiny", layout="rows:data", steps=2), out, err=err)
    assert len(losses) == 2 and "examples/s" not in out.getvalue()
    assert (
        err.getvalue() == "meshdsl train: note: model good.py has no examples_per_step(), so no throughput is shown\n"
    )


def test_a_users_model_is_never_taken_for_a_shipped_one(models_dir: Path) -> None:
    """A user's module called mlp (userpkg.mlp) gets no byte formula and no plain-JAX baseline of the shipped MLP
    (they would read fields it lacks); the shipped MLP gets both."""
    from meshdsl.bench import analytic, baselines
    from meshdsl.model.loader import build_model, shipped_name
    from meshdsl.train import optim

    (models_dir / "userpkg" / "mlp.py").write_text(MODEL)
    importlib.invalidate_caches()  # the folder was listed when userpkg was imported
    mine, shipped = build_model("userpkg.mlp", "tiny"), build_model("mlp", "tiny")
    assert (shipped_name(mine), shipped_name(shipped)) == (None, "mlp")
    mesh = md.Mesh({"data": 8})
    layout = md.Layout("rows:data")
    params = mine.init(jax.random.key(0))
    sgd = optim.make("sgd")
    assert analytic.minimum_bytes(mine, params, mesh, layout, sgd) is None
    assert baselines.make_step(mine, layout, mesh, {"params": params}, None, sgd) is None
    shipped_params = shipped.init(jax.random.key(0))
    assert analytic.minimum_bytes(shipped, shipped_params, mesh, md.Layout("batch:data"), sgd) > 0
