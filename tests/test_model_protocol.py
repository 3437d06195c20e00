"""The model interface (meshdsl.model.protocol): a model with only the core trains and benches, one
without ``loss`` is refused in one line by train, bench and the Trainer (the command line's one line:
tests/test_cli.py, "Model without loss"), and each run builds its model once."""

from __future__ import annotations

import io
from pathlib import Path

import jax
import numpy as np
import pytest

import meshdsl as md
from meshdsl.bench.run import BenchConfig
from meshdsl.bench.run import run as bench
from meshdsl.model import protocol as model_protocol
from meshdsl.model.loader import build_model, load_module
from meshdsl.train import optim
from meshdsl.train.loop import RunConfig, check, train
from meshdsl.train.step import Trainer

ROWS, COLS = 8, 4
LEARNING_RATE = 0.1

CORE = f"""import dataclasses

import jax.numpy as jnp
import numpy as np

import meshdsl as md

BUILT = []
X = np.random.default_rng(0).normal(size=({ROWS}, {COLS})).astype(np.float32)
Y = np.random.default_rng(1).normal(size=({ROWS},)).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Config:
    rows: int = {ROWS}
    cols: int = {COLS}

    PRESETS = {{"tiny": {{}}}}


class Model:
    def __init__(self, config):
        BUILT.append(config)
        self.config = config
        self.rows, self.cols = md.Dim("batch", config.rows), md.Dim("cols", config.cols)

    def init(self, key):
        return {{"w": md.zeros([self.cols])}}

    def batch(self, key):
        return {{"x": md.tensor(jnp.asarray(X), [self.rows, self.cols]), "y": md.tensor(jnp.asarray(Y), [self.rows])}}

    def loss(self, params, batch):
        return md.reduce_mean(md.square(md.einsum(batch["x"], params["w"], out=[self.rows]) - batch["y"]))
"""

NO_LOSS = CORE.replace("    def loss(self, params, batch):", "    def lost(self, params, batch):")


def _reference_losses(steps: int) -> list[float]:
    """The losses of plain SGD on least squares from w = 0, in numpy."""
    x = np.random.default_rng(0).normal(size=(ROWS, COLS)).astype(np.float64)
    y = np.random.default_rng(1).normal(size=(ROWS,)).astype(np.float64)
    w = np.zeros(COLS)
    out = []
    for _ in range(steps):
        err = x @ w - y
        out.append(float(np.mean(err**2)))
        w = w - LEARNING_RATE * 2 * x.T @ err / ROWS
    return out


@pytest.fixture(scope="module")
def core_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("core") / "core_model.py"
    path.write_text(CORE)
    return path


def test_a_model_with_only_the_core_trains_with_the_reference_losses(core_file: Path) -> None:
    built = load_module(str(core_file)).BUILT
    before = len(built)
    run = RunConfig(
        model=str(core_file),
        preset="tiny",
        layout="batch:data",
        steps=3,
        optimizer="sgd",
        learning_rate=LEARNING_RATE,
    )
    model = check(run)  # as the command line does before it starts the devices
    losses = train(run, io.StringIO(), err=io.StringIO(), model=model)
    np.testing.assert_allclose(losses, _reference_losses(3), rtol=1e-5)
    assert len(built) - before == 1, "check builds the model and train uses it"


def test_a_model_with_only_the_core_benches(core_file: Path, tmp_path: Path) -> None:
    built = load_module(str(core_file)).BUILT
    before = len(built)
    notes: list[str] = []
    cfg = BenchConfig(
        models=[str(core_file)],
        preset="tiny",
        layouts=["batch:data"],
        rounds=1,
        steps_per_round=1,
        optimizer="sgd",
        out=str(tmp_path / "bench"),
        gspmd=False,
    )
    (row,) = bench(cfg, out=lambda line: None, warn=notes.append)
    assert row["flops_per_step"] is None and row["mfu"] is None and row["examples_per_s"] is None
    assert row["step_s_median"] > 0
    assert any("has no flops_per_step(), so no FLOP/s or MFU is reported" in n for n in notes), notes
    assert len(built) - before == 1, "bench builds each model once"


def test_a_model_without_loss_is_refused_by_train_and_bench(tmp_path: Path) -> None:
    path = tmp_path / "no_loss.py"
    path.write_text(NO_LOSS)
    with pytest.raises(md.ConfigError, match=r"^model .*no_loss\.py: Model has no loss;") as raised:
        train(RunConfig(model=str(path), preset="tiny", layout="batch:data", steps=1), io.StringIO())
    assert "\n" not in str(raised.value)
    with pytest.raises(md.ConfigError, match=r"^model .*no_loss\.py: Model has no loss;"):
        bench(BenchConfig(models=[str(path)], preset="tiny", layouts=["batch:data"], out=str(tmp_path / "b")))


def test_the_trainer_refuses_an_object_without_the_core(core_file: Path) -> None:
    """A model object made in Python (not loaded by name) is checked where it enters: the Trainer."""

    class Half:
        config = None

        def init(self, key: jax.Array) -> dict:
            return {}

        def batch(self, key: jax.Array) -> dict:
            return {}

    layout = md.Layout("batch:data")
    mesh = md.Mesh({"data": 1}, jax.devices()[:1])
    with pytest.raises(md.ConfigError, match=r"has no loss\(\): every model defines init\(key\), batch\(key\)"):
        Trainer(Half(), optim.sgd(), mesh, layout)
    assert isinstance(build_model(str(core_file), "tiny"), model_protocol.Model)
    assert not isinstance(Half(), model_protocol.Model)


def test_capabilities_of_the_shipped_and_a_core_model(core_file: Path) -> None:
    transformer = build_model("transformer", "tiny")
    mlp = build_model("mlp", "tiny")
    core = build_model(str(core_file), "tiny")
    assert model_protocol.capabilities(core) == frozenset()
    assert {"flops_per_step", "examples_per_step", "LAYOUTS", "pre", "layer", "post"} <= (
        model_protocol.capabilities(transformer)
    )
    assert model_protocol.has_pipeline_parts(transformer) and not model_protocol.has_pipeline_parts(mlp)
    assert not model_protocol.has_pipeline_parts(core)
    assert model_protocol.stacked_layers(transformer) == md.Dim("layers", transformer.config.layers)
    assert model_protocol.stacked_layers(core) is None
    counts = model_protocol.step_counts(transformer)
    c = transformer.config
    assert (counts.unit, counts.examples) == ("tokens", c.batch * c.length)
    assert model_protocol.step_counts(core) == model_protocol.StepCounts(None, None, "examples")
    assert model_protocol.layouts(mlp) == tuple(load_module("mlp").Model.LAYOUTS)


def test_a_trainer_fed_batches_needs_no_batch_method() -> None:
    """A model without ``batch`` trains on batches the caller gives (SGD on a linear loss: numpy's
    update); given a data key instead, the step says the model has no batch()."""

    class Fed:
        config = None

        def init(self, key: jax.Array) -> dict:
            return {"w": md.zeros([md.Dim("d", 3)])}

        def loss(self, params: dict, batch: dict) -> md.Tensor:
            return md.reduce_mean(md.reduce_sum(params["w"] * batch["x"], "d"))

    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    mesh = md.Mesh({"data": 2}, jax.devices()[:2])
    trainer = Trainer(Fed(), optim.sgd(0.5), mesh, md.Layout("batch:data"), donate=False)
    state = trainer.init(jax.random.key_data(jax.random.key(0)))
    state, loss = trainer.step(state, {"x": md.tensor(x, ["batch", "d"])})
    assert float(loss) == 0.0
    np.testing.assert_allclose(np.asarray(state["params"]["w"].array), -0.5 * x.mean(0), rtol=1e-6)
    with pytest.raises(md.ConfigError, match=r"has no batch\(\)"):
        trainer.step(state, jax.random.key_data(jax.random.key(1)))


def test_the_command_line_builds_each_model_once(core_file: Path, tmp_path: Path, capsys) -> None:
    """``meshdsl train`` and ``meshdsl bench`` run the model their check built."""
    from meshdsl.cli import main

    built = load_module(str(core_file)).BUILT
    before = len(built)
    assert main(["train", "--model", str(core_file), "--preset", "tiny", "--layout", "batch:data", "--steps", "1"]) == 0
    assert len(built) - before == 1, "train"
    before = len(built)
    args = ["--model", str(core_file), "--preset", "tiny", "--layouts", "batch:data", "--rounds", "1", "--no-gspmd"]
    assert main(["bench", *args, "--steps-per-round", "1", "--out", str(tmp_path / "b")]) == 0
    assert len(built) - before == 1, "bench"
    capsys.readouterr()
