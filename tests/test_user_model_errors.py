"""Mistakes in the user's own model file, as ``meshdsl train --model my_model.py`` meets them: each is
one line on stderr naming the user's file and line and what meshdsl expected, exit status 2, no
traceback (importing the file, ``Config``, ``Model(config)``, ``init``, ``batch``, ``loss``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import harness
import pytest

GOOD = """import dataclasses

import jax
import jax.numpy as jnp

import meshdsl as md


@dataclasses.dataclass(frozen=True)
class Config:
    batch: int = 16
    cols: int = 8

    PRESETS = {"tiny": {}}


class Model:
    def __init__(self, config):
        self.config = config
        self.rows, self.cols = md.Dim("batch", config.batch), md.Dim("cols", config.cols)

    def init(self, key):
        return {"w": md.random.normal(key, [self.cols])}

    def batch(self, key):
        x = md.random.normal(key, [self.rows, self.cols])
        return {"x": x, "y": md.square(x)}

    def loss(self, params, batch):
        err = batch["x"] * params["w"] - batch["y"]
        return md.reduce_mean(md.square(err))
"""

LOSS_RETURN = "        return md.reduce_mean(md.square(err))"
LOSS_DEF = "    def loss(self, params, batch):"

# name: (replace this, with that, the line the message names (a snippet of it), texts the message holds)
MISTAKES = {
    "loss returns a vector": (
        LOSS_RETURN,
        "        return md.reduce_mean(md.square(err), 'cols')",
        LOSS_DEF,
        ["Model.loss(params, batch) returned an md tensor [batch=16]", "a scalar float md tensor"],
    ),
    "loss returns a jnp scalar": (
        LOSS_RETURN,
        "        return jnp.mean(md.square(err).array)",
        LOSS_DEF,
        ["Model.loss(params, batch) returned an array float32[]", "a scalar float md tensor"],
    ),
    "loss returns a float": (
        LOSS_RETURN,
        "        return 1.5",
        LOSS_DEF,
        ["Model.loss(params, batch) returned float 1.5", "a scalar float md tensor"],
    ),
    "loss returns an int": (LOSS_RETURN, "        return 3", LOSS_DEF, ["returned int 3", "a scalar float md tensor"]),
    "loss returns an int tensor": (
        LOSS_RETURN,
        "        return md.cast(md.reduce_mean(md.square(err)), 'int32')",
        LOSS_DEF,
        ["returned an md tensor [] of int32", "a scalar float md tensor"],
    ),
    "loss reads a missing key": (
        'err = batch["x"]',
        'err = batch["z"]',
        'err = batch["z"]',
        ["Model.loss(params, batch) failed", "KeyError: 'z'"],
    ),
    "loss has the wrong signature": (
        LOSS_DEF,
        "    def loss(self, params):",
        "    def loss(self, params):",
        ["Model.loss takes (self, params)", "loss(params, batch)"],
    ),
    "loss makes a shape mistake": (
        'err = batch["x"]',
        'err = md.reduce_sum(batch["x"], "rows") + batch["x"]',
        'md.reduce_sum(batch["x"], "rows")',
        ["reduce_sum", "'rows'"],
    ),
    "init raises": (
        '        return {"w": md.random.normal(key, [self.cols])}',
        '        raise RuntimeError("no weights file")',
        'raise RuntimeError("no weights file")',
        ["Model.init(key) failed", "RuntimeError: no weights file"],
    ),
    "init returns arrays": (
        '        return {"w": md.random.normal(key, [self.cols])}',
        '        return {"w": jnp.zeros(8)}',
        "    def init(self, key):",
        ["Model.init(key) returned", "float32[8]", "md tensors"],
    ),
    "init returns integer params": (
        '        return {"w": md.random.normal(key, [self.cols])}',
        '        return {"w": md.cast(md.random.normal(key, [self.cols]), "int32")}',
        "    def init(self, key):",
        ["Model.init(key) returned an md tensor of int32 at ['w']", "a float md tensor"],
    ),
    "Model(config) raises": (
        "        self.config = config",
        "        self.config = config.missing_field",
        "config.missing_field",
        ["Model(config) failed", "AttributeError", "missing_field"],
    ),
    "batch raises": (
        "        x = md.random.normal(key, [self.rows, self.cols])",
        "        x = 1 / 0",
        "x = 1 / 0",
        ["Model.batch(key) failed", "ZeroDivisionError"],
    ),
    "batch returns a list": (
        '        return {"x": x, "y": md.square(x)}',
        "        return [x, md.square(x)]",
        'err = batch["x"]',
        ["Model.loss(params, batch) failed", "TypeError: list indices"],
    ),
    "batch returns arrays": (
        '        return {"x": x, "y": md.square(x)}',
        '        return {"x": x, "y": x.array}',
        "    def batch(self, key):",
        ["Model.batch(key) returned an array float32[16, 8]", "['y']", "md tensors"],
    ),
    "Config rejects its values": (
        '    PRESETS = {"tiny": {}}',
        '    PRESETS = {"tiny": {}}\n\n    def __post_init__(self):\n        raise RuntimeError("cols must be odd")',
        'raise RuntimeError("cols must be odd")',
        ["Config(", "RuntimeError: cols must be odd"],
    ),
    "exit at import": (
        "import dataclasses\n",
        "import dataclasses\nimport sys\nsys.exit(0)\n",
        "sys.exit(0)",
        ["importing it", "sys.exit(0)"],
    ),
}


def _meshdsl(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "meshdsl.cli", *args],
        cwd=tmp_path,
        env=harness.subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def _line_of(text: str, snippet: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if snippet in line)


@pytest.mark.parametrize("case", list(MISTAKES))
def test_a_mistake_in_the_users_model_is_one_line_naming_file_and_line(case: str, tmp_path: Path) -> None:
    old, new, where, needles = MISTAKES[case]
    assert old in GOOD, case
    text = GOOD.replace(old, new, 1)
    (tmp_path / "my_model.py").write_text(text)
    done = _meshdsl(
        tmp_path, "train", "--model", "my_model.py", "--preset", "tiny", "--steps", "1", "--layout", "batch:data"
    )
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    line = lines[0]
    assert line.startswith("meshdsl train: error: "), line
    assert f"my_model.py:{_line_of(text, where)}" in line, (case, line)
    assert "meshdsl_user_model" not in line, line
    for needle in needles:
        assert needle in line, (case, needle, line)


def test_the_good_model_trains(tmp_path: Path) -> None:
    """The model every mistake above starts from trains (so each failure is the mistake's)."""
    (tmp_path / "my_model.py").write_text(GOOD)
    done = _meshdsl(
        tmp_path, "train", "--model", "my_model.py", "--preset", "tiny", "--steps", "1", "--layout", "batch:data"
    )
    assert done.returncode == 0, done.stderr


def test_errors_name_the_users_file_not_an_internal_module(tmp_path: Path) -> None:
    """A model that cannot be pipelined is named by its file (llama.py), not by the name meshdsl imported it under."""
    (tmp_path / "llama.py").write_text(GOOD)
    done = _meshdsl(
        tmp_path,
        "train",
        "--model",
        "llama.py",
        "--preset",
        "tiny",
        "--steps",
        "1",
        "--layout",
        "batch:data",
        "--microbatches",
        "2",
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "cannot be pipelined" in done.stderr and "llama.py" in done.stderr, done.stderr
    assert "meshdsl_user_model" not in done.stderr, done.stderr


def test_a_good_model_through_the_loader_trains_like_the_raw_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checks around the user's model change no number: its loss through build_model equals the raw Model's."""
    import jax
    import numpy as np

    from meshdsl.model.loader import build_model, load_module

    (tmp_path / "checked.py").write_text(GOOD)
    monkeypatch.chdir(tmp_path)
    model = build_model("checked.py", "tiny")
    module = load_module("checked.py")
    raw = module.Model(module.Config())
    key = jax.random.key(3)
    got = model.loss(model.init(key), model.batch(key)).numpy()
    params, batch = raw.init(key), raw.batch(key)
    x, w = np.asarray(batch["x"].array), np.asarray(params["w"].array)
    np.testing.assert_allclose(got, np.mean(np.square(x * w - x * x)), rtol=1e-6)
    assert model.config == module.Config()


def test_a_preset_with_a_zero_size_is_refused(tmp_path: Path) -> None:
    """A preset's own values are checked like --set's: a size of 0 would train on empty tensors, printing zeros."""
    (tmp_path / "my_model.py").write_text(GOOD.replace('PRESETS = {"tiny": {}}', 'PRESETS = {"tiny": {"cols": 0}}'))
    done = _meshdsl(
        tmp_path, "train", "--model", "my_model.py", "--preset", "tiny", "--steps", "1", "--layout", "batch:data"
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip() == (
        "meshdsl train: error: model my_model.py preset tiny: cols=0, but cols takes an integer of at least 1"
    ), done.stderr


COMMANDS = {
    "bench": [
        "bench",
        "--layouts",
        "batch:data",
        "--rounds",
        "1",
        "--steps-per-round",
        "1",
        "--no-gspmd",
        "--out",
        "results",
    ],
    "explain": ["explain", "--layout", "batch:data", "--no-compile", "--profile", "cpu-sim"],
    "search": ["search", "--profile", "cpu-sim", "--out", "best.toml"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_reports_a_model_mistake_the_same_way(command: str, tmp_path: Path) -> None:
    """bench and search stop at a mistake in the model (the same under every layout) instead of skipping
    every layout as not fitting; explain says the same line as train."""
    old, new, where, needles = MISTAKES["loss returns a vector"]
    text = GOOD.replace(old, new, 1)
    (tmp_path / "my_model.py").write_text(text)
    done = _meshdsl(
        tmp_path, *COMMANDS[command][:1], "--model", "my_model.py", "--preset", "tiny", *COMMANDS[command][1:]
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, (done.returncode, done.stdout, done.stderr)
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith(f"meshdsl {command}: error: my_model.py:{_line_of(text, where)}"), line
    assert all(needle in line for needle in needles), line
    assert "skipped" not in done.stdout and "no layout fits" not in line, (done.stdout, line)


PIPELINED = """from meshdsl.models import transformer

import meshdsl as md

Config = transformer.Config


class Model(transformer.Model):
    def pre(self, params, batch):
        return super().pre(params, batch)

    def layer(self, x, p):
        return super().layer(x, p)

    def post(self, params, x, batch):
        return super().post(params, x, batch)
"""

# name: (replace this, with that, the line the message names (a snippet of it), texts the message holds)
PIPELINE_MISTAKES = {
    "pre reads a missing key": (
        "return super().pre(params, batch)",
        'return super().pre(params, batch["missing"])',
        'batch["missing"]',
        ["Model.pre(params, batch) failed", "KeyError: 'missing'"],
    ),
    "layer returns a tuple": (
        "return super().layer(x, p)",
        "return super().layer(x, p), None",
        "    def layer(self, x, p):",
        ["Model.layer(x, p) returned tuple", "meshdsl needs an md tensor (the activations)"],
    ),
    "post makes a shape mistake": (
        "return super().post(params, x, batch)",
        'return md.reduce_sum(super().post(params, x, batch), "nope")',
        '"nope"',
        ["Model.post(params, x, batch) failed", "'nope'"],
    ),
}


@pytest.mark.parametrize("case", list(PIPELINE_MISTAKES))
def test_a_mistake_in_a_pipeline_part_is_one_line_naming_file_and_line(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The pipeline parts (pre, layer, post) of a user's model are checked as init, batch and loss are (issue 21)."""
    from meshdsl.cli import main

    old, new, where, needles = PIPELINE_MISTAKES[case]
    assert old in PIPELINED, case
    text = PIPELINED.replace(old, new, 1)
    (tmp_path / "my_model.py").write_text(text)
    monkeypatch.chdir(tmp_path)
    code = main(["train", "--model", "my_model.py", "--preset", "tiny", "--steps", "1", "--layout", "pipeline"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"meshdsl train: error: my_model.py:{_line_of(text, where)}"), (case, line)
    for needle in needles:
        assert needle in line, (case, needle, line)


def test_with_batch_gives_a_checked_model_whose_parts_compute_the_raw_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``with_batch`` of a user's model (a pipeline's microbatch model) is checked too, and the wrapped
    parts return the user's own results: post(layer(pre)) equals the raw model's loss."""
    import jax
    import numpy as np

    import meshdsl as md
    from meshdsl.model.loader import build_model, load_module
    from meshdsl.model.user import UserModel

    (tmp_path / "piped.py").write_text(PIPELINED)
    monkeypatch.chdir(tmp_path)
    model = build_model("piped.py", "tiny")
    micro = model.with_batch(4)
    assert isinstance(micro, UserModel) and micro.config.batch == 4
    module = load_module("piped.py")
    raw = module.Model(module.Config.preset("tiny", batch=4))

    def both() -> tuple[jax.Array, jax.Array]:
        params, batch = raw.init(jax.random.key(0)), raw.batch(jax.random.key(1))
        x, _ = md.scan(lambda c, p: (micro.layer(c, p), None), micro.pre(params, batch), params["layers"], "layers")
        return micro.post(params, x, batch).array, raw.loss(params, batch).array

    got, want = jax.jit(both)()
    np.testing.assert_allclose(got, want, rtol=1e-5)
